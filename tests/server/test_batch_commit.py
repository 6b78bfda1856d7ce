"""engine/batch/commit.py: one batched compaction of every request's accepted path gives, bitwise,
the pooled K / V and path features of the per-request ``KVCache.keep`` + ``index_select``."""

from __future__ import annotations

import random

import torch

from ddtree_server.engine.batch.commit import commit_paths
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.kv_cache import KVCache

from tests.server.batch_fixtures import Unpinned


def _pool(seed):
    torch.manual_seed(seed)
    pool = SlotPool(lambda: KVCache(3, 2, 40, 4, torch.float32, "cpu"), 5)
    for t in pool.tensors.values():
        t.copy_(torch.randn_like(t))
    return pool


def _random_path(rng, n):
    path, j = [0], 0
    while j < n - 1 and rng.random() < 0.8:
        j = rng.randint(j + 1, n - 1)
        path.append(j)
    return path


def test_batched_commit_equals_per_request_keep():
    rng = random.Random(4)
    for trial in range(20):
        batched, alone = _pool(trial), _pool(trial)
        slots = rng.sample(range(5), rng.randint(1, 5))
        sizes = [rng.choice([1, 2, 7, 17]) for _ in slots]
        starts = [rng.randint(0, 40 - n) for n in sizes]
        paths = [_random_path(rng, n) for n in sizes]
        if trial == 0:
            paths = [list(range(n)) for n in sizes]       # nothing moves
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        feats = torch.randn(sum(sizes), 6)
        for pool in (batched, alone):
            for slot, s, n in zip(slots, starts, sizes):
                pool[slot].length = s + n
        got = commit_paths(batched.pool("k"), batched.pool("v"), feats, slots, starts, offsets, paths, "cpu",
                           Unpinned() if trial % 2 else None)
        for slot, s, a, path, ctx in zip(slots, starts, offsets, paths, got):
            alone[slot].keep(s, path)
            assert torch.equal(ctx, feats.index_select(0, torch.tensor(path) + a))
        for name in ("k", "v"):
            assert torch.equal(batched.pool(name), alone.pool(name))
        assert commit_paths(batched.pool("k"), batched.pool("v"), None, slots, starts, offsets, paths, "cpu") \
            == [None] * len(slots)


def test_batched_commit_through_page_tables_equals_per_request_keep():
    """The paged layout (engine/batch/paged.py): rows located through each slot's (scattered)
    page table move within the page pools as ``PagedKV.keep`` moves them per request."""
    from ddtree_server.engine.batch.paged import PagedSlots
    from tests.server.tiny import tiny_target

    rng = random.Random(9)
    model = tiny_target()
    for trial in range(10):
        torch.manual_seed(trial)
        batched, alone = (PagedSlots(model, 40, 5, 60, "cpu") for _ in range(2))
        for paged in (batched, alone):   # the same scattered tables: a page at a time, slots shuffled
            order = random.Random(trial).sample(range(5), 5)
            for rows in (16, 32, 48, 60):
                for slot in order:
                    assert paged.reserve(slot, rows)
            paged.kv.k.copy_(torch.randn(paged.kv.k.shape, generator=torch.Generator().manual_seed(trial)))
            paged.kv.v.copy_(-paged.kv.k)
        slots = rng.sample(range(5), rng.randint(1, 5))
        sizes = [rng.choice([1, 2, 7, 17]) for _ in slots]
        starts = [rng.randint(0, 60 - n) for n in sizes]
        paths = [_random_path(rng, n) for n in sizes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        feats = torch.randn(sum(sizes), 6)
        got = commit_paths(batched.pool("k"), batched.pool("v"), feats, slots, starts, offsets, paths, "cpu",
                           Unpinned() if trial % 2 else None, paged=batched)
        for slot, s, a, path, ctx in zip(slots, starts, offsets, paths, got):
            alone[slot].keep(s, path)
            assert torch.equal(ctx, feats.index_select(0, torch.tensor(path) + a))
        for name in ("k", "v"):
            assert torch.equal(batched.pool(name), alone.pool(name))
