"""HybridTarget (Qwen3.5 / Qwen3.6) vs transformers' Qwen3_5ForCausalLM, and loading real layouts.

fp32 on CPU, tiny random ``Qwen3_5TextConfig``s (conv kernel 4, 4 value heads over 2 key heads,
several GDN / attention layer patterns). Tree verification is tested in test_hybrid_tree.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_server.models.hybrid.config import HybridConfig, HybridConfigError
from ddtree_server.models.common import TargetLoadError
from ddtree_server.models.families import detect_family
from ddtree_server.models.load import load_target
from tests.server.hybrid_fixtures import PATTERNS, hf_model, ours, random_state, tiny_config

TOL = 1e-4
HF_PATTERNS = ["3gdn+attn", "attn-first", "mixed6"]  # deeper random stacks amplify fp32 rounding past 1e-4


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.mark.parametrize("pattern", HF_PATTERNS)
@pytest.mark.parametrize("method", ["chunk", "node"])
def test_prefill_and_decode_equal_transformers(pattern, method):
    cfg = tiny_config(pattern)
    state = random_state(cfg, seed=1, scale=2.0)
    hf, model = hf_model(cfg, state), ours(cfg, state, method)
    ids = torch.randint(0, 256, (72,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = hf(ids[None], position_ids=torch.arange(72)[None], use_cache=False).logits[0]
        got, _ = model.forward(model.new_cache(128), ids, torch.arange(72))  # > tree scratch: chunked prefill
        assert (got - full).abs().max() <= TOL
        out = hf(ids[None, :40], position_ids=torch.arange(40)[None], use_cache=True)
        past, cache = out.cache, model.new_cache(128)
        got, _ = model.forward(cache, ids[:40], torch.arange(40))  # pending chain, settled by the next step
        assert (got - out.logits[0]).abs().max() <= TOL
        for t in range(40, 72):  # 32 single-token decode steps
            ref = hf(ids[None, t:t + 1], position_ids=torch.tensor([[t]]), cache=past, use_cache=True)
            past = ref.cache
            step, _ = model.forward(cache, ids[t:t + 1], torch.tensor([t]))
            assert (step[0] - ref.logits[0, 0]).abs().max() <= TOL, t
    assert cache.length == 72


def test_captured_features_equal_transformers_hidden_states():
    cfg = tiny_config("mixed6")
    state = random_state(cfg, seed=3, scale=2.0)
    hf, model = hf_model(cfg, state), ours(cfg, state)
    model.capture_layers = [0, 2, 4]
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids[None], position_ids=torch.arange(30)[None], use_cache=False, output_hidden_states=True)
        _, feats = model.forward(model.new_cache(64), ids, torch.arange(30))
    want = torch.cat([ref.hidden_states[k + 1][0] for k in (0, 2, 4)], dim=-1)
    assert feats.shape == (30, 3 * 64) and (feats - want).abs().max() <= TOL


def _save(model, folder, tokenizer=True):
    model.save_pretrained(folder)
    if tokenizer:
        from tests.server.hybrid_folders import write_tokenizer

        write_tokenizer(folder)


@pytest.mark.parametrize("layout", ["text", "multimodal"])
def test_load_target_folder_layouts(tmp_path, layout):
    from tests.server.hybrid_folders import write_hybrid_folder

    folder = write_hybrid_folder(tmp_path / layout, multimodal=layout == "multimodal", seed=5)
    loaded = load_target(folder)
    assert loaded.tree_mode_available and "qwen3_5" in loaded.message and "tree mode available" in loaded.message
    cfg = tiny_config("3gdn+attn")
    hf = hf_model(cfg, random_state(cfg, seed=5))
    ids = torch.randint(0, 256, (25,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf(ids[None], position_ids=torch.arange(25)[None], use_cache=False).logits[0]
        got, _ = loaded.model.forward(loaded.model.new_cache(64), ids, torch.arange(25))
    assert (got - ref).abs().max() <= TOL
    assert loaded.config.multimodal is (layout == "multimodal")


def test_multimodal_load_never_reads_the_vision_tower(tmp_path):
    """The vision tower's shard is unreadable garbage: loading must not open it."""
    from tests.server.hybrid_folders import write_hybrid_folder

    folder = write_hybrid_folder(tmp_path / "mm", multimodal=True, seed=7, split_vision=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {v for k, v in index.items() if k.startswith("model.visual.")}
    assert vision_files and not vision_files & {v for k, v in index.items() if not k.startswith("model.visual.")}
    for name in vision_files:
        (folder / name).write_bytes(b"not a safetensors file")
    loaded = load_target(folder)
    assert loaded.tree_mode_available


def test_missing_language_tensor_named(tmp_path):
    from tests.server.hybrid_folders import write_hybrid_folder

    folder = write_hybrid_folder(tmp_path / "bad", multimodal=False, seed=8, drop="model.layers.1.linear_attn.in_proj_b.weight")
    with pytest.raises(TargetLoadError, match=r"layers\.1\.linear_attn\.in_proj"):
        load_target(folder)


def test_family_detection_lines():
    ok, msg = detect_family({"model_type": "qwen3_5", "text_config": {}})
    assert ok and "tree mode available" in msg
    ok, msg = detect_family({"model_type": "qwen3_5_text"})
    assert ok
    for mt in ("qwen3_5_moe", "qwen3_next", "mamba"):
        ok, msg = detect_family({"model_type": mt})
        assert not ok and mt in msg and "plain autoregressive decoding" in msg


def test_config_errors_name_the_key():
    raw = tiny_config("3gdn+attn").to_dict()
    with pytest.raises(HybridConfigError, match="layer_types"):
        HybridConfig.from_any({**raw, "layer_types": ["linear_attention"]})
    with pytest.raises(HybridConfigError, match="linear_num_value_heads"):
        HybridConfig.from_any({**raw, "linear_num_value_heads": 3})
    with pytest.raises(HybridConfigError, match="rope_type"):
        HybridConfig.from_any({**raw, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})
    cfg = HybridConfig.from_any({"model_type": "qwen3_5", "text_config": {**raw, "layer_types": None}})
    assert cfg.multimodal and cfg.layer_types == tuple(PATTERNS["3gdn+attn"])


def test_moe_hybrid_falls_back_to_plain_decoding(tmp_path):
    """qwen3_5_moe is not run by our HybridTarget: transformers' model, ar only, said at start-up."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from ddtree_server.models.hf_runner import HFRunner
    from tests.server.hybrid_folders import write_tokenizer

    cfg = Qwen3_5MoeTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, shared_expert_intermediate_size=16,
                               layer_types=["linear_attention", "full_attention"])
    Qwen3_5MoeForCausalLM(cfg).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_target(tmp_path)
    assert isinstance(loaded.model, HFRunner) and not loaded.tree_mode_available
    assert "qwen3_5_moe" in loaded.message and "plain autoregressive decoding" in loaded.message
