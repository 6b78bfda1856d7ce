"""engine/batch/paged_kv.py against the slot cache (models/kv_cache.py): rounds of writes (a block of
rows after the committed ones) and compactions to a random accepted path, several requests on
shuffled pages, every layer; after every round each request's rows read through its page table
equal its slot cache's, and another request's rows are untouched."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_server.engine.batch.paged_kv import PagedKV
from ddtree_server.engine.batch.pages import PagePool
from ddtree_server.models.kv_cache import KVCache

LAYERS, HKV, D = 3, 2, 8


def test_rounds_of_writes_and_compactions_equal_the_slot_cache():
    rng = random.Random(3)
    torch.manual_seed(3)
    pages = PagePool(40, page_size=16)
    pages._free = rng.sample(pages._free, len(pages._free))          # a churned free list
    kv = PagedKV(LAYERS, 40, HKV, D, torch.float32, "cpu")
    slots = {rid: KVCache(LAYERS, HKV, 160, D, torch.float32, "cpu") for rid in "abc"}
    for rid, cache in slots.items():                                 # prompts of different lengths
        n = rng.randint(5, 40)
        assert pages.reserve(rid, n)
        new = torch.randn(2, LAYERS, n, HKV, D)
        for layer in range(LAYERS):
            kv.write(layer, pages.table([rid])[0], 0, new[0, layer], new[1, layer])
            cache.k[layer, :, :n] = new[0, layer].transpose(0, 1)
            cache.v[layer, :, :n] = new[1, layer].transpose(0, 1)
        cache.length = n
    moved = 0
    for _ in range(6):                                               # rounds: state carried over 5
        for rid, cache in slots.items():
            s, n = cache.length, rng.randint(1, 17)
            assert pages.reserve(rid, s + n)
            table = pages.table([rid])[0]
            new = torch.randn(2, LAYERS, n, HKV, D)
            for layer in range(LAYERS):
                kv.write(layer, table, s, new[0, layer], new[1, layer])
                cache.k[layer, :, s:s + n] = new[0, layer].transpose(0, 1)
                cache.v[layer, :, s:s + n] = new[1, layer].transpose(0, 1)
            cache.length = s + n
            path = sorted(rng.sample(range(n), rng.randint(1, n)))   # the accepted rows, root first
            moved += path != list(range(len(path)))
            kv.keep(table, s, path)
            cache.keep(s, path)
        for rid, cache in slots.items():
            for layer in range(LAYERS):
                k, v = kv.gather(layer, pages.table([rid])[0], cache.length)
                assert torch.equal(k, cache.k[layer, :, :cache.length]), (rid, layer)
                assert torch.equal(v, cache.v[layer, :, :cache.length]), (rid, layer)
    assert moved >= 5                                                # compactions that moved rows
    assert len({p for t in pages.tables.values() for p in t}) > 3    # the requests span several pages


def test_a_row_past_the_table_is_refused():
    kv = PagedKV(1, 4, HKV, D, torch.float32, "cpu")
    table = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(IndexError, match="past the 1 pages"):
        kv.write(0, table, 10, torch.zeros(7, HKV, D), torch.zeros(7, HKV, D))


def test_changed_tables_are_reported_once():
    """The device copy of the page tables (``PagedSlots.table``) is refreshed from
    ``take_changed``: a new table, a grown one and a released one are reported, once; a reserve
    within the pages already held is not."""
    pool = PagePool(9)
    assert pool.reserve(0, 20) and pool.reserve(1, 5)
    assert sorted(pool.take_changed()) == [0, 1] and pool.take_changed() == []
    assert pool.reserve(0, 32) and pool.reserve(1, 16)   # within the pages held
    assert pool.take_changed() == []
    assert pool.reserve(1, 17) and pool.release(0) == 2
    assert sorted(pool.take_changed()) == [0, 1]
