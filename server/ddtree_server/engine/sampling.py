"""Sampling parameters and the target's token choice (greedy or seeded sampling).

Verification (ddtree.md §2.4) applies the request's temperature / top-p to the TARGET logits of
every verified position and then either takes the argmax (T = 0) or draws one token per position
(sample-and-match); draft probabilities never enter. Everything here works on whole ``[n, vocab]``
blocks so a round needs one kernel sequence and one device-to-host copy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    """Per-request decoding parameters (docs/architecture.md, Engine contract).

    max_tokens: >= 1 new tokens; temperature: 0 -> greedy (exact); top_p in (0, 1];
    seed: seeds the request's torch.Generator (None: random); stop: stop strings;
    stop_token_ids: extra stop tokens (EOS is always added by the engine unless ignore_eos).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


def processed_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-p nucleus, renormalised.

    logits: ``[n, vocab]`` (any float dtype); returns fp32 probabilities ``[n, vocab]``.
    The nucleus keeps the smallest set of highest-probability tokens whose mass reaches top_p
    (always at least the most probable token). Requires temperature > 0.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
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
