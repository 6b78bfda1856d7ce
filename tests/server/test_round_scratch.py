"""The hybrid verify scratch of the batch engine is one per ROUND, not one per slot (engine/batch/runner.py,
models/hybrid/cache.py ``VerifyScratch``): a slot's bytes are its KV, committed GDN state and conv
state (computed here from the config); the scratch is allocated once per engine and every slot's
cache views it; a round whose trees would need more rows than the scratch has is cut to fit
(``trees.fit_rows``: each tree a prefix of its nodes) and stays exact: over 20+ rounds with
arrivals, cancellations and slot reuse, eager and in the padded layout of the CUDA graphs (run
eagerly on the CPU), every request's tokens equal its tokens alone and ``ar``'s (fp32)."""

from __future__ import annotations

import pytest
import torch
from ddtree_server.api.metrics import Metrics
from ddtree_server.engine.batch import trees
from ddtree_server.engine.batch.pools import cache_bytes, measured, slot_cache_bytes
from ddtree_server.engine.engine import Engine, slots_for
from ddtree_server.speculative.tree import DraftTree, chain_tree, root_only

from tests.server.batch_fixtures import MAX_LEN, check_alone_batched_ar, oracle_drafter, random_specs
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, ByteTokenizer


def _tree(parents: list[int]) -> DraftTree:
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    return DraftTree(list(range(len(parents))), depth, parents, all(p == i - 1 for i, p in enumerate(parents) if i))


def test_fit_rows_cuts_trees_to_prefixes_within_the_rows():
    big = _tree([-1, 0, 0, 1, 1, 2, 3, 6])   # 8 nodes, branched
    got = trees.fit_rows([big, chain_tree(5, [1, 2, 3, 4]), root_only(9)], cap=6, total=None)
    assert [t.size for t in got] == [6, 5, 1] and got[0].parents == big.parents[:6] and not got[0].is_chain
    got = trees.fit_rows([big, chain_tree(5, [1, 2, 3, 4]), root_only(9)], cap=None, total=8)
    assert sum(t.size for t in got) == 8 and [t.size for t in got] == [4, 3, 1]   # water-filled shares
    assert got[1].is_chain and got[1].tokens == [5, 1, 2]
    assert [t.size for t in trees.fit_rows([big, big], cap=None, total=2)] == [1, 1]   # roots alone: plain
    assert trees.fit_rows([big], cap=None, total=100)[0] is big


def test_hybrid_slot_bytes_leave_out_the_round_scratch():
    target = tiny_hybrid("3gdn+attn", seed=21)
    cfg = target.config
    engine = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=3,
                    round_rows=40)
    runner = engine.batch.runner
    gdn, attn = len(cfg.gdn_layers), len(cfg.attn_layers)
    hv, dk, dv, k = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, \
        cfg.linear_conv_kernel_dim
    cap = 40   # the slots' pending blocks: min(TREE_ROWS, the scratch's rows)
    kv = 2 * attn * cfg.num_key_value_heads * (MAX_LEN + 1) * cfg.head_dim * 4
    slot = kv + gdn * hv * dk * dv * 4 + gdn * (k - 1) * cfg.conv_dim * 4
    scratch = 40 * (gdn * hv * (dk + dv + 1) * 4 + gdn * cfg.conv_dim * 4 + k * 8)
    assert runner.caches.slot_bytes == engine.batch.slot_bytes == engine.slot_bytes == slot
    assert engine.batch.scratch_bytes == engine.batch.memory.scratch_bytes == runner.scratch.nbytes == scratch
    # allocated once: no pooled scratch tensor, every slot's cache views the engine's one scratch
    for name in ("kk", "uu", "GG", "win", "inputs"):
        with pytest.raises(KeyError):
            runner.caches.pool(name)
    names = ("kk", "uu", "GG", "win", "inputs")
    ptrs = {tuple(getattr(c, n).data_ptr() for n in names) for c in runner.caches.caches}
    assert ptrs == {tuple(runner.scratch.tensors()[n].data_ptr() for n in names)}
    assert all(c.cap == cap for c in runner.caches.caches)
    # a standalone cache keeps its own scratch of TREE_ROWS rows; the slot's bytes leave it out
    own = target.new_cache(MAX_LEN + 1)
    assert not own.scratch.shared and own.cap == 80
    assert slot_cache_bytes(own) == slot
    # the CUDA sizing's figures (Engine._slot_bytes): a slot as the engine allocates it at the
    # default rows (3 slots: 240 rows padded to 256, cap 80), the scratch once at its most rows (1,024)
    default = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=3)
    assert default.batch.runner.scratch.rows == 256
    assert default._slot_bytes() == (default.slot_bytes, 1024 * scratch // 40)
    # the sizing measures caches on the meta device: a billion rows are measured, not allocated
    from tests.server.batch_fixtures import real_drafter
    from tests.server.tiny import tiny_target
    for model in (target, tiny_target(), real_drafter(tiny_target(layers=3))):
        assert measured(lambda m=model: m.new_cache(10**9), cache_bytes) > 10**11
    # /metrics: the slot and the round scratch apart
    m = Metrics()
    m.observe_memory(engine.batch.memory)
    text = m.render().decode()
    assert f"ddtree_slot_bytes {float(slot)}" in text and f"ddtree_round_scratch_bytes {float(scratch)}" in text
    # CUDA sizing: the scratch counted once, then whole slots
    assert slots_for(10 * slot + scratch, slot, 1.0, once=scratch) == 10
    assert slots_for(10 * slot + scratch - 1, slot, 1.0, once=scratch) == 9


@pytest.mark.parametrize("padded", ["0", "1"])
def test_rounds_past_the_scratch_are_cut_and_equal_alone_and_ar(padded, monkeypatch):
    """4 slots, trees of up to 17 nodes and DFlash chains of 8, a scratch of 12 rows: most rounds
    need more rows than it has and are cut (counted), yet every request equals alone and ``ar``."""
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", padded)
    torch.set_num_threads(1)
    target = tiny_hybrid("3gdn+attn", seed=21)
    target.capture_layers = [1, 2]
    modes = [("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ar", None)]
    specs = [dict(s, mode=modes[i % 4][0], budget=modes[i % 4][1], params=dict(s["params"], max_tokens=10 + i % 17))
             for i, s in enumerate(random_specs(seed=5, count=9))]
    drafter, ar = oracle_drafter(target, specs)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=4, poison_freed_slots=True, round_rows=12)
    cuts, fit = [], trees.fit_rows

    def counted(ts, cap, total):
        out = fit(ts, cap, total)
        cuts.append(sum(t.size for t in ts) > sum(t.size for t in out))
        assert total is None or sum(t.size for t in out) <= max(total, len(out))
        return out

    monkeypatch.setattr(trees, "fit_rows", counted)
    check_alone_batched_ar(engine, specs, ar)
    assert engine.batch.steps >= 20 and sum(cuts) >= 10, (engine.batch.steps, sum(cuts))
    graphs = engine.batch.runner.graphs
    if padded == "1":
        assert graphs.pending_rounds > 0, graphs.pending_rounds


def test_the_default_scratch_holds_the_padded_layout_of_every_slots_largest_tree(monkeypatch):
    """``round_rows``: the rows the graphs' padded layout takes for every slot's tree of 80 nodes
    (a scratch smaller than that sends a lone request's DDTree rounds to the eager path); a lone
    request's 65-node trees then take the padded layout, exact."""
    from ddtree_server.engine.batch.hybrid_rounds import ROUND_ROWS, round_rows
    from ddtree_server.engine.sampling import SamplingParams

    from tests.server.batch_fixtures import real_drafter

    assert [round_rows(None, s) for s in (1, 2, 8, 12, 64)] == [80, 160, 640, 1024, ROUND_ROWS]
    assert round_rows(40, 1) == 40
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")
    target = tiny_hybrid("3gdn+attn", seed=21)
    drafter = real_drafter(target, block=16)
    ids, params = list(b"the cat sat"), SamplingParams(max_tokens=20, ignore_eos=True)
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    want = [t for ev in ar.generate(ids, params, mode="ar") for t in ev.token_ids]
    # on pages a lone request takes the batched rounds (on slots, slot 0's per-request forward)
    engine = Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                    max_running=1, kv_layout="paged", tree_budget=64)
    got = [t for ev in engine.generate(ids, params, mode="ddtree") for t in ev.token_ids]
    graphs = engine.batch.runner.graphs
    assert got == want and graphs.pending_rounds > 5 and engine.batch.runner.last.nodes == 64
