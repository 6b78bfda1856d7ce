"""Prompt chunks of several requests in one batched target forward.

A step's prompt chunks (``Scheduler.chunks``) are causal blocks: request r's tokens
``[p_r, p_r + n_r)`` at positions ``p_r ..`` of its slot, after the ``p_r`` rows already there. One
``dense_forward`` over all of them (``forward.py``: flattened rows, per-request attention over its
own slot) writes every chunk's K/V and returns its features; the LM head runs on the last row of
each chunk only. It does what each chunk's own forward on its slot (``StepRunner.prefill``) does,
for the price of one forward instead of one per request: under a burst of arrivals the first
tokens come sooner and the decode rounds between the chunks wait less. ``finish_chunk`` is the
bookkeeping both paths share. Hybrid targets take it on the paged layout (``forward_hybrid``'s
``prefill``: attention batched through the page tables, each chunk's GDN rows committed by its
request's mixer on its slot's state); on slots they keep the per-request forward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine.batch.forward import Block, Layout, dense_forward
from ddtree_server.engine.batch.forward_hybrid import hybrid_forward
from ddtree_server.engine.batch.request import Request


def check_chunk(req: Request, n: int, cache_length: int) -> None:
    """A chunk must continue the request's prompt where its slot's cache ends."""
    p, total = req.prefilled, len(req.prefill_ids)
    if n <= 0 or p + n > total:
        raise ValueError(f"prompt chunk [{p}, {p + n}) outside the prompt of {total} tokens")
    if cache_length != p:
        raise RuntimeError(f"slot {req.slot} holds {cache_length} rows, the prompt chunk starts at {p}")


def finish_chunk(req: Request, n: int, last_logits: Tensor, ctx: Tensor | None) -> list[int] | None:
    """After a chunk's forward: its features join the prompt's (speculative requests), and after
    the last chunk the first token is chosen from the last row's logits ``[1, vocab]``; returns
    ``[first token]`` then, else None. A preempted request's recompute (``req.resume``) chooses
    nothing: its rows are back, its bonus token is the one it had; returns ``[]``."""
    req.prefilled += n
    total = len(req.prefill_ids)
    if ctx is not None and req.mode != "ar":
        req.ctx_parts.append(ctx)
    if req.prefilled < total:
        return None
    out = []
    if req.resume is None:
        token = req.choose(last_logits, [-1], [req.prompt_ids[-1]], [total])[0]
        req.bonus, out = token, [token]
        req.accept(out)  # the last chunk's last row chose it
    req.s, req.resume = total, None
    parts, req.ctx_parts = req.ctx_parts, []
    req.ctx = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None
    return out


def prefill_one(runner, req: Request, n: int) -> list[int] | None:
    """The request's next ``n`` prompt tokens in one forward (``StepRunner.prefill``): on pages the
    batched forward through the page table, on slots the per-request forward on its slot's cache
    (slot 0 may take the target's CUDA graphs, bound to its storage; other slots run eagerly)."""
    if runner.paged:
        return prefill_many(runner, [(req, n)])[0]
    p, cache = req.prefilled, runner.caches[req.slot]
    check_chunk(req, n, cache.length)
    ids = torch.tensor(req.prefill_ids[p:p + n], dtype=torch.long, device=runner.device)
    model = runner.target if req.slot == 0 else runner.model
    logits, ctx = model.forward(cache, ids, torch.arange(p, p + n, device=runner.device), last_only=True)
    # graphed forwards return views of static buffers
    return finish_chunk(req, n, logits, None if ctx is None or req.mode == "ar" else ctx.clone())


def prefill_many(runner, chunks: list[tuple[Request, int]]) -> list[list[int] | None]:
    """Every ``(request, n)`` chunk in one forward; per chunk ``finish_chunk``'s result."""
    blocks = []
    for req, n in chunks:
        cache = runner.caches[req.slot]
        check_chunk(req, n, cache.length)
        p = req.prefilled
        blocks.append(Block(req.slot, p, req.prefill_ids[p:p + n], list(range(n)), None))
    lay = Layout(blocks, runner.device, pages=runner.tables(blocks))
    last = torch.tensor([o - 1 for o in lay.offsets[1:]], device=runner.device)
    k, v = runner.caches.pool("k"), runner.caches.pool("v")
    if runner.kind == "hybrid":
        caches = [runner.caches[req.slot] for req, _ in chunks]
        logits, feats = hybrid_forward(runner.model, caches, k, v, lay, prefill=True, logit_rows=last)
    else:
        logits, feats = dense_forward(runner.model, k, v, lay, logit_rows=last)
    out = []
    for i, ((req, n), a) in enumerate(zip(chunks, lay.offsets)):
        runner.caches[req.slot].length = req.prefilled + n
        ctx = None if feats is None or req.mode == "ar" else feats[a:a + n].clone()
        out.append(finish_chunk(req, n, logits[i:i + 1], ctx))
    return out
