"""The batched CUDA graphs keep their outputs in one buffer per runner (engine/batch/graph_out.py):
the graph pool no longer grows by one logits block per captured shape, and the replays, which now
overwrite each other's output, still give every request its tokens alone (fp32, several rounds,
batch sizes and widths changing as requests arrive and finish). The target's and the drafter's
batched graphs share one pool, and past the memory headroom new shapes run eagerly with the same
tokens (engine/batch/graph_pool.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.batch.graph_out import SharedOut
from ddtree_server.engine.batch.graph_pool import HEADROOM_ENV, GraphPool, headroom_bytes, may_capture
from ddtree_server.engine.sampling import SamplingParams


def test_shared_out_keeps_what_fits_and_returns_the_rest():
    out = SharedOut(8)
    out.reserve("logits", torch.zeros(4, 3))
    buf = out.bufs["logits"]
    assert buf.shape == (8, 3) and out.nbytes == 8 * 3 * 4
    x = torch.arange(12.0).view(4, 3)
    kept = out.keep("logits", x)
    assert kept.data_ptr() == buf.data_ptr() and torch.equal(kept, x) and kept.shape == (4, 3)
    for other in (torch.zeros(9, 3), torch.zeros(2, 5), torch.zeros(2, 3, dtype=torch.float64)):
        assert out.keep("logits", other) is other   # too many rows, another width, another dtype
    assert out.keep("feats", x) is x and out.keep("logits", None) is None
    out.reserve("big", torch.zeros(9, 2))          # past the limit: no buffer, outputs stay their own
    assert "big" not in out.bufs


def test_capture_rule_and_headroom_setting(monkeypatch):
    assert may_capture(3 << 30, 3 << 30) and not may_capture((3 << 30) - 1, 3 << 30)
    monkeypatch.delenv(HEADROOM_ENV, raising=False)
    assert headroom_bytes() == 3072 << 20
    for raw, want in (("512", 512 << 20), ("0", 0), ("-5", 0), ("lots", 3072 << 20)):
        monkeypatch.setenv(HEADROOM_ENV, raw)
        assert headroom_bytes() == want, raw
    pool = GraphPool("cpu", headroom=1 << 60)
    assert pool.room() and pool.refused == 0     # no device memory to run short of on the CPU


def test_the_largest_round_every_slot_a_chain_within_the_round_limits():
    from ddtree_server.engine.batch.graphs import MAX_ROWS, ROW_BUCKETS
    from ddtree_server.engine.batch.reserve import round_sizes

    assert round_sizes(4, None, None) == [ROW_BUCKETS[-1]] * 4           # dense, few slots: the largest row bucket
    many = round_sizes(150, None, None)                                  # dense: MAX_ROWS in all, spread evenly
    assert sum(many) == MAX_ROWS and max(many) - min(many) <= 1
    assert round_sizes(150, 65, 1024) == [7] * 124 + [6] * 26            # hybrid: within its round scratch
    assert sum(round_sizes(3, 16, 1024)) == 48                           # ... and its verify scratch per slot
    assert round_sizes(5, 16, 2) == [1] * 5                              # one row each at the least


def test_the_cpu_runner_measures_no_reserve(monkeypatch):
    monkeypatch.setenv("DDTREE_BATCH_GRAPHS", "1")   # the padded layout, run eagerly: no device memory to keep
    eng, _, _ = _engine_and_jobs("cpu")
    pool = eng.batch.runner.graph_pool
    assert eng.batch.runner.graphs is not None and pool.reserve == 0 and pool.pool_bytes == 0
    from ddtree_server.engine.batch.reserve import largest_round

    from tests.server.hybrid_fixtures import tiny_hybrid

    hybrid, _, _ = _engine_and_jobs("cpu", tiny_hybrid("3gdn+attn", seed=3))
    for runner in (eng.batch.runner, hybrid.batch.runner):   # the measure's forwards run on the CPU too
        assert largest_round(runner) == 0                      # (nothing to measure there) and free the slots
        assert all(c.length == 0 for c in runner.caches.caches) and all(c.length == 0 for c in runner.dcaches.caches)
    alone, batched, _ = _alone_and_together(eng, *_engine_and_jobs("cpu")[1:])
    assert batched == alone                                    # and leave nothing behind in them


def _engine_and_jobs(device="cuda", target=None):
    from ddtree_server.engine.engine import Engine
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.model import DFlashDrafter

    from tests.server.tiny import EOS, VOCAB, ByteTokenizer, tiny_target

    t = (tiny_target() if target is None else target).to(device)
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": [1, 2]}, "num_hidden_layers": 1,
           "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    d = DFlashDrafter(DrafterConfig.from_dict(raw), t.embed_tokens, t.lm_head).eval().to(device)
    eng = Engine(t, ByteTokenizer(), d, eos_token_ids=[EOS], max_model_len=96, max_running=6)
    words = [b"abc def", b"hello hello", b"xy", b"the cat sat", b"1+2=", b"zz top", b"a", b"mat on a"]
    jobs = [(list(w), ("ar", "ddtree", "dflash")[i % 3]) for i, w in enumerate(words)]

    counter = iter(range(1, 100))

    def params():
        return SamplingParams(max_tokens=6 + 5 * (next(counter) % 4), ignore_eos=True)

    return eng, jobs, params


def _alone_and_together(eng, jobs, params):
    from tests.server.batch_fixtures import run_together

    alone = [[x for ev in eng.generate(ids, SamplingParams(max_tokens=6 + 5 * ((i + 1) % 4), ignore_eos=True),
                                       mode=m) for x in ev.token_ids] for i, (ids, m) in enumerate(jobs)]
    batched, sizes = run_together(eng, jobs, params)
    return alone, batched, sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batched_graphs_share_their_outputs_and_equal_alone():
    eng, jobs, params = _engine_and_jobs()
    alone, batched, sizes = _alone_and_together(eng, jobs, params)
    assert batched == alone and max(sizes) == 6
    graphs, drafts = eng.batch.runner.graphs, getattr(eng.batch.runner, "draft_graphs", None)
    statics = list(graphs._static.values())
    assert len(statics) >= 3, "several padded shapes were captured"
    buf = graphs.out.bufs["logits"]
    assert all(st.logits.data_ptr() == buf.data_ptr() for st in statics)   # one buffer, not one per shape
    if drafts is not None and drafts._static:
        dbuf = drafts.out.bufs["logits"]
        assert all(st.logits.data_ptr() == dbuf.data_ptr() for st in drafts._static.values() if st.graph)
    # one pool for both families: every captured segment of the batched rounds is in it
    pool = eng.batch.runner.graph_pool
    assert graphs.pool is pool and (drafts is None or drafts.pool is pool)
    assert pool.handle is not None and pool.captured == len(statics) + sum(
        1 for st in (drafts._static.values() if drafts is not None else ()) if st.graph) and pool.refused == 0
    segs = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)]
    assert tuple(pool.handle) in {tuple(seg["segment_pool_id"]) for seg in segs}
    # the bytes the captures took, counted from the allocator's reserved growth, are the pool's segments
    # (ddtree_cuda_graph_pool_bytes), and the largest eager round was measured
    ours = sum(seg["total_size"] for seg in segs if tuple(seg["segment_pool_id"]) == tuple(pool.handle))
    assert ours > 0 and ours / 2 <= pool.pool_bytes <= ours * 2, (pool.pool_bytes, ours)
    assert pool.reserve > 0
    mem = eng.batch.memory   # what /metrics shows (ddtree_cuda_graph_pool_bytes ...)
    assert (mem.graph_pool_bytes, mem.eager_reserve_bytes, mem.graphs_captured, mem.graph_declined_rounds) == (
        pool.pool_bytes, pool.reserve, pool.captured, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rounds_past_the_headroom_run_eagerly_and_equal_alone(monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, str(1 << 30))   # more than any device has free: nothing is captured
    eng, jobs, params = _engine_and_jobs()
    alone, batched, sizes = _alone_and_together(eng, jobs, params)
    assert batched == alone and max(sizes) == 6
    runner = eng.batch.runner
    assert runner.graphs.rounds > 0 and not runner.graphs._static
    assert runner.graph_pool.captured == 0 and runner.graph_pool.refused > 0 and runner.graph_pool.handle is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_capture_whose_warm_up_would_eat_the_headroom_runs_eagerly(monkeypatch):
    """Free memory reads as the largest eager round's reserve and the headroom plus one byte: every new shape passes the first check,
    its measured warm-up then shows the capture would eat into the headroom, and the round runs
    eagerly; the shape is not warmed up again while that much is not free."""
    import ddtree_server.engine.batch.graph_pool as gp

    eng, jobs, params = _engine_and_jobs()
    pool = eng.batch.runner.graph_pool
    monkeypatch.setattr(gp, "device_free", lambda device: pool.headroom + pool.reserve + 1)
    alone, batched, sizes = _alone_and_together(eng, jobs, params)
    assert batched == alone and max(sizes) == 6
    runner = eng.batch.runner
    assert pool.captured == 0 and pool.handle is None and not runner.graphs._static
    assert runner.graphs._refused and all(need > 1 for need in runner.graphs._refused.values())
    drafts = runner.draft_graphs
    if drafts is not None:
        assert all(st.graph is None for st in drafts._static.values())
        assert any(st.need > 1 for st in drafts._static.values())
    # each refused shape was warmed up once; later rounds of it ran eagerly without a warm-up
    assert pool.refused >= len(runner.graphs._refused) and runner.graphs.rounds > len(runner.graphs._refused)
