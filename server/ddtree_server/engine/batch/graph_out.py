"""Outputs of the batched CUDA graphs in buffers shared by every graph of one runner.

A captured graph's output tensors (logits ``[N_pad, vocab]``, features, draft logits) come from the
graph pool and stay allocated as long as the graph holds them, so the pool grew by one output per
captured shape: on one H200 a Qwen3-8B server filling 152 slots had 7.5 GiB in graph pools after 33
requests decoded, and ran out of memory at a 566 MiB logits block of one more shape
(docs/benchmarks/h200-2026-12-03/). Here each output is copied, inside the capture, into the leading
rows of one buffer per output allocated outside the pool (its shape taken from the warm-up run); the
graph's own output is then freed when the capture ends and later captures reuse that memory. The
replays of a runner's graphs overwrite each other's output, which is what their callers were told
already: an output is valid until the next forward. A shape whose output does not fit keeps its own.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SharedOut:
    """Named output buffers of up to ``limit`` rows (dim 0)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.bufs: dict[str, Tensor] = {}

    def reserve(self, name: str, like: Tensor | None) -> None:
        """Before a capture: the buffer for outputs like ``like`` (a warm-up run's), allocated once."""
        if like is not None and name not in self.bufs and like.shape[0] <= self.limit:
            self.bufs[name] = torch.empty((self.limit, *like.shape[1:]), dtype=like.dtype, device=like.device)

    def keep(self, name: str, out: Tensor | None) -> Tensor | None:
        """Inside a capture: ``out`` copied into the buffer's leading rows (the view is returned), or
        ``out`` itself when it does not fit the buffer."""
        buf = self.bufs.get(name)
        if out is None or buf is None or out.shape[0] > buf.shape[0] or out.shape[1:] != buf.shape[1:] \
                or out.dtype != buf.dtype:
            return out
        view = buf[: out.shape[0]]
        view.copy_(out)
        return view

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())
