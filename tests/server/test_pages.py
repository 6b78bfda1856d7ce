"""engine/batch/pages.py: the page free list, page tables and the look-ahead plan of a round
(tree -> chain -> plain, then preemption of the newest), and a 10,000-request soak that ends with
every page free, the invariants checked after every step."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_server.engine.batch.pages import Ask, PageError, PagePool, plan_round


def test_reserve_is_all_or_nothing_and_never_hands_out_the_dummy():
    pool = PagePool(6, page_size=16, check=True)          # pages 1..5 usable
    assert pool.reserve("a", 17) and pool.tables["a"] == [1, 2]
    assert pool.reserve("a", 32) and pool.held("a") == 2   # 32 rows still fit two pages
    assert not pool.reserve("b", 16 * 4)                   # 4 pages asked, 3 free: nothing taken
    assert pool.free_pages == 3 and "b" not in pool.tables
    assert pool.reserve("b", 48) and pool.free_pages == 0 and 0 not in pool.tables["b"]
    assert pool.release("a") == 2 and pool.free_pages == 2 and pool.used_pages == 3
    assert pool.reserve("c", 1) and pool.tables["c"] == [1]    # freed pages are reused, lowest first


def test_table_pads_with_the_dummy_page():
    pool = PagePool(8, page_size=4)
    pool.reserve("a", 9)
    pool.reserve("b", 2)
    t = pool.table(["b", "a"])
    assert t.dtype == torch.int32 and t.tolist() == [[4, 0, 0], [1, 2, 3]]
    assert pool.table(["a"], width=5).tolist() == [[1, 2, 3, 0, 0]]
    with pytest.raises(ValueError, match="more than the width"):
        pool.table(["a"], width=2)


def test_verify_finds_a_page_held_twice_or_lost():
    pool = PagePool(5)
    pool.reserve("a", 20)
    pool.tables["b"] = [pool.tables["a"][0]]
    with pytest.raises(PageError, match="held twice"):
        pool.verify()
    del pool.tables["b"]
    pool.tables["a"].pop()
    with pytest.raises(PageError, match="lost"):
        pool.verify()


def _pool(usable: int, rids: str = "abc") -> PagePool:
    pool = PagePool(usable + 1, page_size=16)
    for rid in rids:
        pool.reserve(rid, 32)                              # 2 pages each
    return pool


def test_a_round_shrinks_the_newest_first_then_preempts_the_newest():
    asks = [Ask(rid, 32, tree=65, chain=16, order=i) for i, rid in enumerate("abc")]
    # a tree of 65 rows after 32: 7 pages, 5 more each; a chain of 16: 1 more; plain: 1 more
    assert plan_round(_pool(21), asks) == ({"a": 65, "b": 65, "c": 65}, [])     # 15 free: all trees
    assert plan_round(_pool(17), asks) == ({"a": 65, "b": 65, "c": 16}, [])     # 11 free
    assert plan_round(_pool(16), asks) == ({"a": 65, "b": 16, "c": 16}, [])     # 10 free
    assert plan_round(_pool(9), asks) == ({"a": 16, "b": 16, "c": 16}, [])      # 3 free
    asks = [Ask(rid, 31, tree=65, chain=16, order=i) for i, rid in enumerate("abc")]
    assert plan_round(_pool(6), asks) == ({"a": 1, "b": 1, "c": 1}, [])         # plain fits the held pages
    asks = [Ask(rid, 32, tree=65, chain=16, order=i) for i, rid in enumerate("abc")]
    assert plan_round(_pool(6), asks) == ({"a": 1, "b": 1}, ["c"])              # c's pages cover a and b
    assert plan_round(_pool(2, "a"), asks[:1]) == ({"a": 1}, [])               # the oldest is never preempted


def test_a_drafting_request_reserves_its_draft_block_unless_plain():
    """A tree of 3 rows after 30 rows (2 pages held) with a draft block of 16: its reservation is
    the block's 46 rows (3 pages, 1 more), a plain round's 1 row (no draft, nothing more)."""
    ask = Ask("a", 30, tree=3, chain=3, order=0, draft=16)
    assert (ask.rows(3), ask.rows(1), Ask("a", 30, 3, 3, 0).rows(3)) == (16, 1, 3)
    assert plan_round(_pool(3, "a"), [ask]) == ({"a": 3}, [])      # 1 page free: the block's page
    assert plan_round(_pool(2, "a"), [ask]) == ({"a": 1}, [])      # none free: plain, no draft
    ddtree = [Ask(rid, 30, tree=3, chain=3, order=i, draft=16) for i, rid in enumerate("ab")]
    assert plan_round(_pool(5, "ab"), ddtree) == ({"a": 3, "b": 1}, [])   # 1 free page: the oldest drafts


def test_ten_thousand_requests_leave_every_page_free():
    rng = random.Random(7)
    pool = PagePool(200, page_size=16)
    running: dict[int, list[int]] = {}                     # rid -> [s, order, left]
    queue, next_rid, done, preempted = [], 0, 0, 0
    while done < 10_000:
        while len(queue) < 4 and next_rid < 10_000:
            queue.append((next_rid, rng.randint(1, 300), rng.randint(1, 120)))
            next_rid += 1
        while queue and pool.reserve(queue[0][0], queue[0][1] + 1):   # admission by free pages
            rid, prompt, gen = queue.pop(0)
            running[rid] = [prompt, rid, gen]
        pool.verify()                                       # the invariants after every step
        if not running:
            continue
        asks = [Ask(r, v[0], tree=rng.choice((17, 33, 65)), chain=16, order=v[1]) for r, v in running.items()]
        grant, pre = plan_round(pool, asks)
        for rid in pre:                                     # recompute later: prompt + generated so far
            s, order, left = running.pop(rid)
            pool.release(rid)
            queue.insert(0, (rid, s, left))
            preempted += 1
        for rid, rows in grant.items():
            s, order, left = running[rid]
            assert pool.reserve(rid, s + rows), (rid, s, rows)
            acc = min(left, rng.randint(1, rows))
            running[rid] = [s + acc, order, left - acc]
        for rid in [r for r, v in running.items() if v[2] == 0 or rng.random() < 0.01]:   # finished / cancelled
            del running[rid]
            pool.release(rid)
            done += 1
    pool.verify()
    assert not running and not queue and pool.free_pages == 199 and not pool.tables
    assert preempted > 0                                    # the soak did reach preemption
