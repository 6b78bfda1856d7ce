"""Sampling parameters and the target's token choice (greedy or seeded sampling).

Verification (DDTree, arXiv 2604.12989; docs/server.md §3) applies the request's temperature / top-p to the TARGET logits of
every verified position and then either takes the argmax (T = 0) or draws one token per position
(sample-and-match); draft probabilities never enter. Temperatures below GREEDY_TEMPERATURE are
greedy; see `SamplingParams` for how extreme values are treated. Everything here works on whole ``[n, vocab]``
blocks so a round needs one kernel sequence and one device-to-host copy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ddtree_server.engine.logprobs import MAX_TOP_LOGPROBS

# Temperatures below this are greedy decoding (argmax), the limit of softmax(logits / T) as T -> 0.
# Same threshold as vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py). Below it, logits / T can
# overflow fp32 (T = 1e-39 is a denormal, 5e-324 rounds to 0 in fp32) and the sampler would see
# NaN; at or above it, `processed_probs` is finite for every finite logit row (it subtracts the
# row maximum before dividing, so the largest scaled logit is exactly 0).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding parameters (docs/architecture.md, Engine contract).

    max_tokens: >= 1 new tokens; temperature: finite, >= 0; below GREEDY_TEMPERATURE (1e-5,
    0 included) -> greedy (exact); top_p in (0, 1]: a top_p so small that it rounds to 0 in fp32
    keeps only the most probable token (the nucleus is never empty);
    seed: seeds the request's torch.Generator (None: random); stop: stop strings;
    stop_token_ids: extra stop tokens (EOS is always added by the engine unless ignore_eos).
    Logits processing (engine/processors.py, applied per tree node, exact under speculation):
    presence_penalty / frequency_penalty in [-2, 2] (0 = off), repetition_penalty > 0 (1 = off),
    logit_bias: token id -> bias in [-100, 100], grammar: a ``constrained.compiler.Grammar`` (None =
    unconstrained). logprobs: None = off, else 0..20 alternatives per emitted token
    (engine/logprobs.py).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    grammar: Any = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not (isinstance(tok, int) and tok >= 0):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= int(self.logprobs) <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature below GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE


def processed_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-p nucleus, renormalised.

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
        probs = processed_probs(logits, self.params.temperature, self.params.top_p)
        return torch.multinomial(probs, 1, generator=self.generator).view(-1).tolist()
