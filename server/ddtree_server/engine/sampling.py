"""The target's token choice (greedy or seeded sampling) under a request's SamplingParams
(engine/params.py, torch-free).

Verification (DDTree, arXiv 2604.12989; docs/server.md §3) applies the request's temperature / top-p to the TARGET logits of
every verified position and then either takes the argmax (T = 0) or draws one token per position
(sample-and-match); draft probabilities never enter. Temperatures below GREEDY_TEMPERATURE are
greedy; see `SamplingParams` for how extreme values are treated. Everything here works on whole ``[n, vocab]``
blocks so a round needs one kernel sequence and one device-to-host copy.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from ddtree_server.engine.params import GREEDY_TEMPERATURE, SamplingParams  # noqa: F401 (the sampling API)

def processed_probs(logits: Tensor, temperature: float, top_p: float, top_k: int = 0) -> Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-k tokens (``top_k`` > 0; ties at
    the k-th probability are kept) and then to the top-p nucleus, renormalised (vLLM's order).

    logits: ``[n, vocab]`` (any float dtype); returns fp32 probabilities ``[n, vocab]``.
    The nucleus keeps the smallest set of highest-probability tokens whose mass reaches top_p
    (always at least the most probable token, also when top_p rounds to 0 in fp32).
    Requires temperature >= GREEDY_TEMPERATURE (smaller ones are greedy: SamplingParams.greedy);
    the row maximum is subtracted before dividing, so no finite logit row overflows to inf/NaN;
    temperatures above fp32's range act as fp32's largest value (a uniform distribution).
    """
    scaled = logits.float()
    # a temperature above fp32's largest value would become inf (and -inf / inf is NaN)
    temperature = min(temperature, torch.finfo(torch.float32).max)
    scaled = (scaled - scaled.amax(dim=-1, keepdim=True)) / temperature
    probs = torch.softmax(scaled, dim=-1)
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = mass_before >= top_p
    drop[..., 0] = False   # the most probable token is always in the nucleus
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)


class TokenChooser:
    """Chooses the target's token at each verified position for one request.

    Greedy: argmax of the raw logits. Sampling: one independent draw per row from
    ``processed_probs`` with the request's generator (seeded by ``params.seed``).
    """

    def __init__(self, params: SamplingParams, device: torch.device | str):
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            seed = params.seed if params.seed is not None else random.getrandbits(63)
            self.generator.manual_seed(int(seed))

    def choose(self, logits: Tensor) -> list[int]:
        """logits ``[n, vocab]`` -> n chosen token ids (one device-to-host copy)."""
        if self.generator is None:
            return logits.argmax(dim=-1).tolist()
        probs = processed_probs(logits, self.params.temperature, self.params.top_p, self.params.top_k)
        return torch.multinomial(probs, 1, generator=self.generator).view(-1).tolist()
