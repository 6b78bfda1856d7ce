"""Engine on a tiny random target (fast): exactness, T > 0 losslessness, modes, errors, cancel, limits."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams, processed_probs
from ddtree_server.models.hf_runner import HFRunner
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter, TableDrafter, tiny_target

LAYERS = [1, 2]
HIDDEN = 64


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = tiny_target()
    yield m
    m.capture_layers = []


def _engine(model, drafter=None, **kw):
    kw.setdefault("max_model_len", 200)
    return Engine(model, ByteTokenizer(), drafter, eos_token_ids=[EOS], **kw)


def _tokens(engine, ids, params, **kw):
    evs = list(engine.generate(ids, params, **kw))
    return [t for ev in evs for t in ev.token_ids], evs[-1]


def _greedy_reference(model, ids, n):
    """Greedy continuation by full recomputation at every step (no cache reuse)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            lg, _ = model.forward(model.new_cache(len(seq)), torch.tensor(seq), torch.arange(len(seq)), last_only=True)
            seq.append(int(lg[0].argmax()))
    return seq[len(ids):]


PROMPTS = [list(b"Hello there"), list(b"The quick brown fox"), list(b"1+1=")]


def test_ar_equals_full_recompute(model):
    engine = _engine(model)
    for ids in PROMPTS:
        toks, last = _tokens(engine, ids, SamplingParams(max_tokens=40, ignore_eos=True))
        assert toks == _greedy_reference(model, ids, 40)
        assert last.finish_reason == "length" and last.stats.mode == "ar"
        assert last.stats.decode_rounds == 39 and last.stats.mean_acceptance_length == 1.0


@pytest.mark.parametrize("mode,budget", [("ddtree", 0), ("ddtree", 1), ("ddtree", 3), ("ddtree", 16),
                                         ("ddtree", 100), ("dflash", None)])
def test_oracle_speculative_equals_ar(model, mode, budget):
    ar = _engine(model)
    for ids in PROMPTS:
        ref, _ = _tokens(ar, ids, SamplingParams(max_tokens=60, ignore_eos=True))
        drafter = OracleDrafter(len(ids), ref, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=8)
        toks, last = _tokens(_engine(model, drafter), ids, SamplingParams(max_tokens=60, ignore_eos=True),
                             mode=mode, tree_budget=budget)
        assert toks == ref
        tau = last.stats.mean_acceptance_length
        if mode == "ddtree" and budget >= 16:
            assert tau > 4.0
        if budget == 0:
            assert tau == 1.0


def test_real_drafter_random_weights_equals_ar(model):
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.config import DrafterConfig

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 6,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 1,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), model.embed_tokens, model.lm_head).eval()
    ar = _engine(model)
    for ids in PROMPTS:
        ref, _ = _tokens(ar, ids, SamplingParams(max_tokens=30, ignore_eos=True))
        eng = _engine(model, drafter)
        assert eng.default_mode == "ddtree" and eng.tree_budget == 5
        for mode, budget in (("dflash", None), ("ddtree", None), ("ddtree", 24)):
            toks, _ = _tokens(eng, ids, SamplingParams(max_tokens=30, ignore_eos=True), mode=mode, tree_budget=budget)
            assert toks == ref, (mode, budget)


# ------------------------------------------------------------------ T > 0
# 750 samples: with every tree node drawing the root's uniform (a position bug) chi2 is ~500 against a
# critical 68; at temperature 1 on tree nodes ~200 (and tokens outside the support); correct: ~25-31
TEMP, TOP_P, SAMPLES = 0.8, 0.8, 750


def _exact_joint(model, ids):
    def dist(seq):
        with torch.no_grad():
            lg, _ = model.forward(model.new_cache(64), torch.tensor(seq), torch.arange(len(seq)), last_only=True)
        p = processed_probs(lg, TEMP, TOP_P)[0]
        return {int(i): float(p[i]) for i in torch.nonzero(p).view(-1)}

    joint, second, third = {}, {}, {}
    for a, pa in dist(ids).items():
        for b, pb in dist(ids + [a]).items():
            second[b] = second.get(b, 0.0) + pa * pb
            for c, pc in dist(ids + [a, b]).items():
                joint[(a, b, c)] = pa * pb * pc
                third[c] = third.get(c, 0.0) + pa * pb * pc
    return joint, second, third


def _chi2_ok(joint, counts, n):
    big = [k for k, p in joint.items() if p * n >= 5]
    cells = [(counts.get(k, 0), joint[k] * n) for k in big]
    cells.append((n - sum(c for c, _ in cells), (1.0 - sum(joint[k] for k in big)) * n))
    chi2 = sum((o - e) ** 2 / e for o, e in cells if e > 1e-9)
    dof = len(cells) - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # ~0.999 quantile
    return chi2, crit


@pytest.fixture(scope="module")
def hybrid_model():
    from tests.server.hybrid_fixtures import tiny_hybrid

    torch.set_num_threads(1)
    return tiny_hybrid("3gdn+attn", seed=31, scale=4.0)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("mode", ["ddtree", "dflash"])
def test_sampling_distribution_equals_ar(request, kind, mode):
    """The first 3 tokens (prefill token, root sample, child sample when it matches) follow
    exactly the law of plain ar sampling with the same temperature / top-p; on a dense target
    and on a hybrid one (Gated DeltaNet states committed along sampled paths)."""
    model = request.getfixturevalue("model" if kind == "dense" else "hybrid_model")
    ids = list(b"Hello")
    joint, second, third = _exact_joint(model, ids)
    rows = [sorted(second, key=second.get, reverse=True)[:3], sorted(third, key=third.get, reverse=True)[:3]]
    drafter = TableDrafter(rows, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS)
    engine = _engine(model, drafter, max_model_len=32)
    counts, one_round = {}, 0
    for seed in range(SAMPLES):
        params = SamplingParams(max_tokens=3, temperature=TEMP, top_p=TOP_P, seed=seed, ignore_eos=True)
        toks, last = _tokens(engine, ids, params, mode=mode, tree_budget=6)
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
        one_round += last.stats.decode_rounds == 1
    assert sum(counts.get(k, 0) for k in joint) == SAMPLES  # nothing outside the support
    assert one_round > SAMPLES // 10  # the 3rd token often came from a tree node
    chi2, crit = _chi2_ok(joint, counts, SAMPLES)
    assert chi2 < crit, (chi2, crit)


def test_seeded_sampling_reproducible(model):
    engine = _engine(model)
    p = SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    assert _tokens(engine, PROMPTS[0], p)[0] == _tokens(engine, PROMPTS[0], p)[0]


# ------------------------------------------------------------------ modes, errors, limits
def test_modes_and_errors(model):
    engine = _engine(model)
    assert engine.default_mode == "ar" and not engine.spec_available
    with pytest.raises(ValueError, match="no drafter"):
        engine.generate([1, 2], SamplingParams(max_tokens=2), mode="ddtree")
    with pytest.raises(ValueError, match="unknown mode"):
        engine.generate([1, 2], SamplingParams(max_tokens=2), mode="beam")
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([1] * 200, SamplingParams(max_tokens=2))
    drafter = TableDrafter([[1]], vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS)
    with pytest.raises(ValueError, match="tree_budget"):
        _engine(model, drafter).generate([1, 2], SamplingParams(max_tokens=2), tree_budget=-1)
    with pytest.raises(ValueError, match="verify trees"):
        _engine(model, drafter, tree_mode_available=False)


def test_max_model_len_clips_to_length(model):
    engine = _engine(model, max_model_len=30)
    toks, last = _tokens(engine, list(b"0123456789"), SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(toks) == 20 and last.finish_reason == "length"
    drafter = OracleDrafter(10, toks, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=8, wrong_every=0)
    spec = _engine(model, drafter, max_model_len=30)
    toks2, last2 = _tokens(spec, list(b"0123456789"), SamplingParams(max_tokens=100, ignore_eos=True), tree_budget=50)
    assert toks2 == toks and last2.finish_reason == "length"


def test_cancel_between_rounds(model):
    engine = _engine(model)
    cancel = threading.Event()
    events = []
    for ev in engine.generate(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True), cancel=cancel):
        events.append(ev)
        if len(events) == 3:
            cancel.set()
    assert events[-1].finish_reason == "cancelled" and events[-1].stats is not None
    assert sum(len(e.token_ids) for e in events) == 3


def test_events_and_stats_consistent(model):
    ref = _greedy_reference(model, PROMPTS[2], 40)
    drafter = OracleDrafter(len(PROMPTS[2]), ref, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=8)
    engine = _engine(model, drafter)
    evs = list(engine.generate(PROMPTS[2], SamplingParams(max_tokens=33, ignore_eos=True)))
    ids = [t for e in evs for t in e.token_ids]
    text = "".join(e.text for e in evs)
    st = evs[-1].stats
    assert ids == ref[:33] and st.generated_tokens == 33 and evs[-1].finish_reason == "length"
    assert text == ByteTokenizer().decode(ids)
    assert all(e.finish_reason is None and e.stats is None for e in evs[:-1])
    assert st.mode == "ddtree" and st.block_size == 8 and st.tree_budget == 7
    assert st.mean_acceptance_length * st.decode_rounds >= 32
    assert set(st.to_dict()) >= {"mode", "decode_rounds", "mean_acceptance_length", "tokens_per_second"}


def test_eos_stops_and_is_not_returned(model):
    ref = _greedy_reference(model, PROMPTS[0], 12)
    engine = _engine(model)
    toks, last = _tokens(engine, PROMPTS[0], SamplingParams(max_tokens=50, stop_token_ids=[ref[5]]))
    assert toks == ref[:ref.index(ref[5])] and last.finish_reason == "stop"


def test_hf_fallback_runner_equals_target():
    """HFRunner (transformers' own model, used for hybrid targets) through the ar loop."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ddtree_server.models.dense.load import build_target

    cfg = AutoConfig.for_model("llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(50)
    ours = build_target(cfg, hf.state_dict(), torch.float32, torch.device("cpu"))
    fallback = Engine(HFRunner(hf), ByteTokenizer(), tree_mode_available=False, max_model_len=100)
    assert fallback.default_mode == "ar"
    with pytest.raises(ValueError):
        fallback.generate([1, 2], SamplingParams(max_tokens=2), mode="dflash")
    p = SamplingParams(max_tokens=25, ignore_eos=True)
    a, _ = _tokens(fallback, PROMPTS[1], p)
    b, _ = _tokens(_engine(ours), PROMPTS[1], p)
    assert a == b


def test_stats_exclude_the_prefill_token(model):
    """tau and tokens/s count decode rounds only; a 1-token request has neither (None, not 0)."""
    engine = _engine(model)
    last = list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=1, ignore_eos=True)))[-1]
    st = last.stats
    assert st.generated_tokens == 1 and st.decode_rounds == 0 and st.decode_tokens == 0
    assert st.mean_acceptance_length is None and st.tokens_per_second is None
    last = list(engine.generate(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True)))[-1]
    st = last.stats
    assert st.decode_rounds == 9 and st.decode_tokens == 9 and st.mean_acceptance_length == 1.0
    assert st.tokens_per_second == pytest.approx(9 / st.decode_seconds)


def test_exactness_check_reports_equal_outputs(model):
    """bench/exactness.check (the GPU exactness command) on the tiny target: all methods equal ar."""
    from ddtree_server.bench.exactness import check

    drafter = TableDrafter([[1, 2], [3, 4]], vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS)
    engine = _engine(model, drafter)
    engine.encode = lambda text, chat=True: list(text.encode())
    report = check(engine, ["Hello there", "1+1="], [("ar", None), ("dflash", None), ("ddtree", 8)], 20)
    assert report["all_equal"] and len(report["rows"]) == 6 and report["drafter_graphs_enabled"] is None
    assert all(r["same_as_ar"] for r in report["rows"]) and report["rows"][2]["tau"] >= 1.0
