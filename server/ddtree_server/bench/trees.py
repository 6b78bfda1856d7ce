"""Draft trees for the benchmarks: DDTree-shaped trees of a given size without a drafter."""

from __future__ import annotations


def ddtree_like(n: int, seed: int = 0, depth: int = 15):
    """A DDTree of n nodes from peaked random draft distributions (best-first, Algorithm 1)."""
    import torch

    from ddtree_server.speculative.tree import build_ddtree

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, 64, generator=g) * 3.0
    logp, ids = torch.log_softmax(logits, -1).topk(n - 1, dim=-1)
    return build_ddtree(0, logp.numpy(), ids.numpy(), n - 1)
