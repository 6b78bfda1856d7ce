"""Sampling keyed by (seed, position): a counter-based uniform and an inverse-CDF draw.

The token at absolute position p of a seeded request is drawn with ``u = uniform(seed, p)`` by
inverse CDF of the target's processed distribution (temperature / top-p, ``processed_probs``).
Every node of a verified tree at position p uses the same u, and only one of them lies on the
accepted path, so the emitted text equals plain autoregressive sampling with the same u's: the
same seed gives the same text alone or in any batch, in every decoding mode (docs/ddtree.md §2.4
keeps its sample-and-match argument). The counter hash is SplitMix64 (Steele, Lea, Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014), computed on the host for the few
rows of a round.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine.sampling import SamplingParams, processed_probs

_M = (1 << 64) - 1


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform in (0, 1) from (seed, position): 53 bits of SplitMix64(SplitMix64(seed) ^ position)."""
    return ((_mix(_mix(seed & _M) ^ (position & _M)) >> 11) + 0.5) * 2.0 ** -53


def choose(logits: Tensor, params: SamplingParams, seed: int, positions: list[int]) -> list[int]:
    """The target's choice for each row of ``logits [n, vocab]``; row i chooses the token at
    absolute position ``positions[i]``. Greedy: argmax; else inverse CDF of
    ``processed_probs`` at ``uniform(seed, position)`` (a token of probability 0 is never drawn)."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = processed_probs(logits, params.temperature, params.top_p)
    cdf = probs.double().cumsum(dim=-1)
    u = torch.tensor([uniform(seed, p) for p in positions], dtype=torch.float64, device=cdf.device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return idx.clamp_(max=logits.shape[-1] - 1).tolist()
