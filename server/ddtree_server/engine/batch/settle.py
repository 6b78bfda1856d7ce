"""The end of a request's round: its choice and acceptance walk, the commit of its slot to the
accepted path (KV compaction / GDN fold through the slot cache's ``keep``) and the request's new
state (s, bonus, drafter context, emitted tokens, counters). Per request; the batched commits of
whole rounds are ``commit.py`` (dense greedy) and ``hybrid_rounds.commit_pending``."""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine import decode
from ddtree_server.engine.batch.request import Request
from ddtree_server.engine.batch.trees import kind_of
from ddtree_server.speculative.tree import DraftTree
from ddtree_server.speculative.walk import accepted_tokens, walk


def commit(runner, req: Request, tree: DraftTree, walked: tuple[list[int], int], feats: Tensor | None,
           staging=None) -> list[int]:
    """Choice, acceptance walk, KV / GDN commit to the path; the request's new s, bonus, ctx.
    ``staging``: a pinned buffer for the path rows (batch 1 only: the round's choice syncs
    before the buffer is reused; several commits of one batched round would race on it)."""
    s, (path, bonus) = req.s, walked
    k = len(path)
    cache = runner.caches[req.slot]
    if tree.size == 1:  # one row: the forward appended it (committed at once on hybrids)
        ctx = feats
    elif path == list(range(k)):
        cache.keep(s, path)
        ctx = None if feats is None else feats[:k]
    else:
        rows = decode.path_rows(path, runner.device, staging)
        cache.keep(s, path, rows)
        ctx = None if feats is None else feats.index_select(0, rows)
    return settle(runner, req, tree, path, bonus, ctx, copy=True)


def choose_and_walk(req: Request, tree: DraftTree, logits: Tensor, choices: list[int] | None) -> tuple[list[int], int]:
    """The request's choice over its rows (unless ``choices`` are given) and acceptance walk."""
    if choices is None:
        choices = req.choose(logits, tree.parents, tree.tokens, [req.s + d + 1 for d in tree.depths])
    return walk(tree, choices)


def settle(runner, req: Request, tree: DraftTree, path: list[int], bonus: int, ctx: Tensor | None,
           copy: bool = False) -> list[int]:
    """The request's state after its committed path: ctx (``ctx``: the path's feature rows;
    ``copy``: they are a view to copy), s, bonus, emitted tokens and counters; returns the tokens."""
    return record(runner, req, path, accepted_tokens(tree, path, bonus), bonus, tree.size, kind_of(tree), ctx, copy)


def device_round(runner, req: Request, got) -> list[int]:
    """A round run on the device (``solo_round.SoloResult``): counted in the runner's round info,
    then the request's new state (``record``); returns the tokens."""
    runner.last.nodes += got.nodes
    runner.last.kinds[got.kind] += 1
    return record(runner, req, got.path, got.tokens, got.bonus, got.nodes + 1, got.kind, got.ctx)


def record(runner, req: Request, path: list[int], out: list[int], bonus: int, size: int, kind: str,
           ctx: Tensor | None, copy: bool = False) -> list[int]:
    k = len(path)
    if req.mode != "ar" and ctx is not None:   # a request that skipped the drafter keeps its rows
        req.ctx = (ctx.clone() if copy else ctx) if req.ctx is None else torch.cat((req.ctx, ctx))
    req.s, req.bonus = req.s + k, bonus
    req.accept(out, path)
    req.nodes += size - 1
    req.kinds[kind] += 1
    if runner.governed(req):
        runner.policy.observe(req, k - 1)
    return out
