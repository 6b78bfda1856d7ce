"""TargetModel vs transformers' own models (fp32): logits, captured features, tree masks, KV compaction."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.models.dense.load import build_target

from ddtree_server.models.families import detect_family

ATOL = 2e-4


def _close(got, want, rel=2e-6):
    """Max abs error within ATOL plus ``rel`` times the largest magnitude (SmolLM2's residual
    stream has outlier channels in the hundreds, so features need a scale-aware bound)."""
    return float((got - want).abs().max()) <= ATOL + rel * float(want.abs().max())


def _prompt(tokenizer, text="Explain in two sentences why the sky is blue."):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return torch.tensor(list(ids))


def _fwd(model, ids, start=0, cache=None, mask=None, positions=None):
    cache = cache if cache is not None else model.new_cache(256)
    pos = positions if positions is not None else torch.arange(start, start + len(ids))
    logits, feats = model.forward(cache, ids, pos, tree_mask=mask)
    return logits, feats, cache


@pytest.mark.slow
def test_logits_and_features_equal_transformers(smollm2, smollm2_hf):
    model = smollm2.model
    ids = _prompt(smollm2.tokenizer)
    model.capture_layers = [1, 14, 27]
    try:
        with torch.no_grad():
            logits, feats, _ = _fwd(model, ids)
            ref = smollm2_hf(ids[None], output_hidden_states=True)
    finally:
        model.capture_layers = []
    assert (logits - ref.logits[0]).abs().max() < ATOL
    want = torch.cat([ref.hidden_states[k + 1][0] for k in (1, 14, 27)], dim=-1)
    assert feats.shape == (len(ids), 3 * 576)
    assert _close(feats, want)


@pytest.mark.slow
def test_incremental_decode_equals_full_forward(smollm2):
    model = smollm2.model
    ids = _prompt(smollm2.tokenizer)
    with torch.no_grad():
        full, _, _ = _fwd(model, ids)
        cache = model.new_cache(256)
        last, _, _ = _fwd(model, ids[:-4], cache=cache)
        assert (last - full[:-4]).abs().max() < ATOL
        for i in range(len(ids) - 4, len(ids)):
            row, _, _ = _fwd(model, ids[i:i + 1], start=i, cache=cache)
            assert (row[0] - full[i]).abs().max() < ATOL
    assert cache.length == len(ids)


def _tree():
    """root + 6 nodes: 0 -> 1, 2 ; 1 -> 3, 4 ; 3 -> 5 ; 2 -> 6 (parents, depths)."""
    parents = [-1, 0, 0, 1, 1, 3, 2]
    depths = [0, 1, 1, 2, 2, 3, 2]
    anc = torch.zeros(7, 7, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return parents, depths, anc


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.slow
def test_tree_masked_forward_equals_sequential(smollm2):
    model = smollm2.model
    prefix = _prompt(smollm2.tokenizer)
    s = len(prefix)
    parents, depths, anc = _tree()
    tokens = torch.tensor([504, 3575, 314, 282, 7042, 4649, 30])
    model.capture_layers = [2, 20]
    try:
        with torch.no_grad():
            _, _, cache = _fwd(model, prefix)
            logits, feats, _ = _fwd(model, tokens, cache=cache, mask=anc,
                                    positions=torch.tensor(depths) + s)
            for node in range(7):
                path = _path(parents, node)
                seq = torch.cat([prefix, tokens[path]])
                ref_logits, ref_feats, _ = _fwd(model, seq)
                assert (logits[node] - ref_logits[-1]).abs().max() < ATOL
                assert _close(feats[node], ref_feats[-1])
    finally:
        model.capture_layers = []


@pytest.mark.slow
def test_kv_compaction_equals_recompute(smollm2):
    model = smollm2.model
    prefix = _prompt(smollm2.tokenizer)
    s = len(prefix)
    parents, depths, anc = _tree()
    tokens = torch.tensor([504, 3575, 314, 282, 7042, 4649, 30])
    keep = [0, 2, 6]  # non-contiguous branch: root -> node 2 -> node 6
    nxt = torch.tensor([1128])
    with torch.no_grad():
        _, _, cache = _fwd(model, prefix)
        _fwd(model, tokens, cache=cache, mask=anc, positions=torch.tensor(depths) + s)
        cache.keep(s, keep)
        assert cache.length == s + 3
        got, _, _ = _fwd(model, nxt, start=s + 3, cache=cache)
        ref_cache = model.new_cache(256)
        ref, _, _ = _fwd(model, torch.cat([prefix, tokens[keep], nxt]), cache=ref_cache)
    assert (got[0] - ref[-1]).abs().max() < ATOL
    n = s + 4
    assert (cache.k[:, :, :n] - ref_cache.k[:, :, :n]).abs().max() < ATOL
    assert (cache.v[:, :, :n] - ref_cache.v[:, :, :n]).abs().max() < ATOL
    # fast path (contiguous rows) is a plain truncation
    cache.keep(s, [0, 1])
    assert cache.length == s + 2
    with pytest.raises(ValueError):
        cache.keep(s, [0, 5])


def _tiny(model_type, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kw.update(extra)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return cfg, hf


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
    ("qwen3", {"tie_word_embeddings": True}),
])
def test_families_equal_transformers(model_type, extra):
    cfg, hf = _tiny(model_type, **extra)
    assert detect_family(cfg)[0]
    model = build_target(cfg, hf.state_dict(), torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got, _, _ = _fwd(model, ids)
    assert (got - ref).abs().max() < 1e-4


def test_bf16_runs():
    cfg, hf = _tiny("qwen3")
    model = build_target(cfg, hf.state_dict(), torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        logits, _, cache = _fwd(model, torch.arange(10))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert cache.k.dtype == torch.bfloat16


@pytest.mark.parametrize("model_type,extra,ok", [
    ("qwen3_next", {}, False),
    ("mamba", {}, False),
    ("gpt2", {}, False),
    ("llama", {"layer_types": ["full_attention", "linear_attention"]}, False),
    ("qwen2", {}, True),
])
def test_detect_family(model_type, extra, ok):
    class Cfg:
        pass

    cfg = Cfg()
    cfg.model_type = model_type
    for k, v in extra.items():
        setattr(cfg, k, v)
    tree_ok, message = detect_family(cfg)
    assert tree_ok is ok
    assert model_type in message
    if not ok:
        assert "tree mode unavailable" in message


def test_cache_full_raises():
    cfg, hf = _tiny("llama")
    model = build_target(cfg, hf.state_dict(), torch.float32, torch.device("cpu"))
    cache = model.new_cache(8)
    with pytest.raises(ValueError):
        model.forward(cache, torch.arange(9), torch.arange(9))


def test_missing_tensor_named():
    from ddtree_server.models.common import TargetLoadError

    cfg, hf = _tiny("llama")
    state = hf.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(TargetLoadError, match=r"layers\.1\.mlp\.gate_up_proj"):
        build_target(cfg, state, torch.float32, torch.device("cpu"))


def test_embedding_is_initialised_like_nn_embedding_and_never_on_meta(monkeypatch):
    from transformers import AutoConfig

    from ddtree_server.models.dense.target import TargetModel

    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    ref = torch.nn.Embedding(64, 16).weight
    torch.manual_seed(0)
    assert torch.equal(TargetModel(cfg).embed_tokens.weight, ref)        # the same random numbers
    normal, seen = torch.nn.init.normal_, []
    monkeypatch.setattr(torch.nn.init, "normal_",
                        lambda *a, **k: seen.append((a or [k.get("tensor")])[0].is_meta) or normal(*a, **k))
    with torch.device("meta"):          # build_target: normal_ on meta imports torch._dynamo (~0.8 s)
        assert TargetModel(cfg).embed_tokens.weight.is_meta
    assert True not in seen
