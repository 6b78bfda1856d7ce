"""The DFlash drafter's context K/V on pages (engine/batch/paged_draft.py, draft.py ``tables=``):
the batched drafter through page tables (pages in a shuffled order, the target's page ids) gives
the proposals of the slot pool bitwise, over several rounds that carry the K/V over (context
appends of 1 .. block rows, a fold of skipped rounds), for a sliding-window layer (in a ring of
32 rows per slot: window 14 and a block of 4, wrapped several times) and a full layer (CPU fp32:
the gathered SDPA path; the kernel path: tests/server/test_kernels_batch.py). A slot whose rings
were poisoned with NaN when freed serves its next request with the slot pool's proposals."""

from __future__ import annotations

import torch
from ddtree_server.engine.batch.draft import fold_context, last_rows, propose_batch
from ddtree_server.engine.batch.draft_graphs import DraftGraphs
from ddtree_server.engine.batch.paged_draft import DraftPages
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.drafter.model import DFlashDrafter

from tests.server.batch_fixtures import real_drafter
from tests.server.tiny import VOCAB, tiny_target

CAP, SLOTS = 112, 4


def _drafter() -> DFlashDrafter:
    torch.manual_seed(3)
    return real_drafter(tiny_target(layers=3), block=4, window=14)


def _tables(width: int) -> tuple[int, torch.Tensor]:
    """Pages 1 .. SLOTS * width in a shuffled order, slot i's table row i; row SLOTS: no pages."""
    perm = torch.randperm(SLOTS * width, generator=torch.Generator().manual_seed(5)) + 1
    tables = torch.zeros((SLOTS + 1, width), dtype=torch.int32)
    tables[:SLOTS] = perm.view(SLOTS, width).to(torch.int32)
    return SLOTS * width + 1, tables


@torch.no_grad()
def test_paged_drafter_proposals_equal_the_slot_pool_bitwise():
    torch.set_num_threads(1)
    d = _drafter()
    width = -(-CAP // PAGE_SIZE)
    num_pages, tables = _tables(width)
    slot = SlotPool(lambda: d.new_cache(CAP), SLOTS, pooled=True)
    paged = DraftPages(d.config, num_pages, SLOTS, CAP, tables, d.dtype, "cpu")
    padded = DraftPages(d.config, num_pages, SLOTS, CAP, tables, d.dtype, "cpu")   # the graphs' layout, eager
    graphs = DraftGraphs(d, padded.pool("k"), padded.pool("v"), capture=False, tables=tables)
    slots, lens = [2, 0, 3, 1], [3, 9, 20, 41]
    gen = torch.Generator().manual_seed(1)
    ctxs = [torch.randn(n, 128, generator=gen) for n in lens]
    for rnd in range(5):
        bonus = [(7 * i + rnd) % VOCAB for i in range(SLOTS)]
        starts = [slot[s].length + x.shape[0] for s, x in zip(slots, ctxs)]
        if rnd == 3:   # a stretch of plain rounds: all but the newest row folded in first
            kept = [fold_context(d, pool.pool("k"), pool.pool("v"), [pool[s] for s in slots], slots, ctxs, tab)
                    for pool, tab in ((slot, None), (paged, tables), (padded, tables))]
            assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*kept))
            ctxs = kept[0]
        a = propose_batch(d, slot.pool("k"), slot.pool("v"), [slot[s] for s in slots], slots, ctxs, bonus, starts)
        b = propose_batch(d, paged.pool("k"), paged.pool("v"), [paged[s] for s in slots], slots, ctxs, bonus, starts,
                          tables)
        assert torch.equal(a, b), (rnd, float((a - b).abs().max()))
        c = graphs.propose([padded[s] for s in slots], slots, ctxs, bonus, starts)   # padded to a bucket
        assert torch.allclose(a, c, atol=1e-5, rtol=1e-5), (rnd, float((a - c).abs().max()))
        assert [paged[s].length for s in slots] == [slot[s].length for s in slots] == starts
        ctxs = [torch.randn(1 + (3 * i + rnd) % 4, 128, generator=gen) for i in range(SLOTS)]
    # nothing was written outside the slots' pages: the dummy page 0 is untouched
    assert not paged.k[0].any() and not paged.v[0].any() and not padded.k[0].any()
    assert graphs.rounds == 4
    # the sliding layer is in rings of one page per slot, the full layer in the target's pages
    assert paged.ring == 2 and paged.k.shape[1] == 1 and paged.rk.shape[:2] == ((SLOTS + 1) * 2, 1)
    assert paged.slot_bytes == 2 * paged.rk[:2].numel() * 4
    # slot 3 freed (its ring poisoned) and taken by a new request: 30 rows at once, then 2 rounds
    paged.poison(3)
    assert paged.rk[6:8].isnan().all() and not paged.rk[:6].isnan().any() and not paged.rk[8:].isnan().any()
    fresh = SlotPool(lambda: d.new_cache(CAP), SLOTS, pooled=True)
    paged[3].length = 0
    ctx = [torch.randn(30, 128, generator=gen)]
    for rnd in range(2):
        start = [paged[3].length + ctx[0].shape[0]]
        a = propose_batch(d, fresh.pool("k"), fresh.pool("v"), [fresh[3]], [3], ctx, [rnd + 1], start)
        b = propose_batch(d, paged.pool("k"), paged.pool("v"), [paged[3]], [3], ctx, [rnd + 1], start, tables)
        assert torch.equal(a, b) and not b.isnan().any(), rnd
        ctx = [torch.randn(3, 128, generator=gen)]


def test_a_long_append_keeps_the_last_ring_of_rows_of_each_slot():
    """Rows of one append that a later row of the same slot overwrites in its ring go to the
    scratch slot: the kept rows of each slot are its newest ``ring`` ones, on distinct ring rows."""
    slot_c = torch.tensor([0] * 40 + [2] * 5 + [1] * 17)
    pos = torch.cat([torch.arange(3, 43), torch.arange(60, 65), torch.arange(0, 17)])
    at = last_rows(slot_c, pos, 16, scratch=4)
    for s, newest in ((0, 42), (2, 64), (1, 16)):
        kept = pos[(at == s)]
        assert kept.tolist() == list(range(max(newest - 15, int(pos[slot_c == s].min())), newest + 1)), s
        assert len(set((kept % 16).tolist())) == len(kept)
    assert int((at == 4).sum()) == 40 - 16 + 1
