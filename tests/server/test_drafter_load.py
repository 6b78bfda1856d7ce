"""DrafterConfig parsing and strict drafter loading / saving (docs/ddtree.md §1.2, §1.3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig, DrafterConfigError, default_layer_ids
from ddtree_server.models.drafter.load import DrafterLoadError, load_drafter, save_drafter
from tests.server.drafter_fixtures import TARGET_HIDDEN, TARGET_LAYERS, VOCAB, randomize, target_parts, zlab_config


def _write(folder, cfg: dict, state: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if state is None:
        emb, head = target_parts()
        drafter = randomize(DFlashDrafter(DrafterConfig.from_dict(cfg), emb, head))
        state = {k: v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return state


def _load(folder, **kw):
    emb, head = target_parts()
    args = dict(embed_tokens=emb, lm_head=head, target_hidden_size=TARGET_HIDDEN,
                target_num_layers=TARGET_LAYERS, target_vocab_size=VOCAB)
    args.update(kw)
    return load_drafter(folder, **args)


def test_zlab_config_parses():
    cfg = DrafterConfig.from_dict(zlab_config(), source="x/config.json")
    assert cfg.block_size == 16 and cfg.mask_token_id == 250 and cfg.target_layer_ids == (1, 3, 5)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.context_width == 3 * 64


def test_block_size_prefers_dflash_config_and_rope_prefers_rope_parameters():
    raw = zlab_config(block_size=16, rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    raw["dflash_config"]["block_size"] = 8
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.block_size == 8 and cfg.rope_parameters["rope_theta"] == 1e7
    raw = zlab_config()
    del raw["rope_theta"]
    with pytest.raises(DrafterConfigError, match="rope_parameters.rope_theta"):
        DrafterConfig.from_dict(raw)


def test_missing_layer_ids_refused_unless_explicit():
    raw = zlab_config()
    del raw["dflash_config"]["target_layer_ids"]
    with pytest.raises(DrafterConfigError, match=r"target_layer_ids.*default rule would give \[1, 5\]"):
        DrafterConfig.from_dict(raw, source="d/config.json")
    assert DrafterConfig.from_dict(raw, target_layer_ids=[2, 6]).target_layer_ids == (2, 6)
    with pytest.raises(DrafterConfigError, match="requested"):
        DrafterConfig.from_dict(zlab_config(), target_layer_ids=[2, 6])
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]


@pytest.mark.parametrize("change, key", [
    ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
    ({"architectures": ["DSparkDraftModel"]}, "architectures"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures"),
    ({"speculators_model_type": "dflash"}, "speculators_model_type"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 8}, "layer_types"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "output_multiplier": 2.0}},
     "dflash_config.output_multiplier"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"dflash_config": {"mask_token_id": 999, "target_layer_ids": [1]}}, "dflash_config.mask_token_id"),
    ({"dflash_config": {"target_layer_ids": [1]}}, "dflash_config.mask_token_id"),
    ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 8]}}, "dflash_config.target_layer_ids"),
])
def test_config_errors_name_file_and_key(change, key):
    with pytest.raises(DrafterConfigError) as err:
        DrafterConfig.from_dict(zlab_config(**change), source="some/config.json")
    assert err.value.key == key and "some/config.json" in str(err.value)


def test_loads_scaled_zlab_checkpoint(tmp_path):
    state = _write(tmp_path / "d", zlab_config())
    drafter = _load(tmp_path / "d")
    got = drafter.state_dict()
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    assert "fc.weight" in got and "layers.1.self_attn.k_norm.weight" in got
    assert not any("embed" in k or "lm_head" in k for k in got)
    assert tuple(got["fc.weight"].shape) == (64, 3 * 64)


def test_sharded_checkpoint(tmp_path):
    state = _write(tmp_path / "d", zlab_config())
    folder = tmp_path / "d"
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    index = {"weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(_load(folder).state_dict()["norm.weight"], state["norm.weight"])


def _mutated(tmp_path, mutate):
    state = _write(tmp_path / "d", zlab_config())
    mutate(state)
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    return tmp_path / "d"


def test_missing_tensor_named(tmp_path):
    folder = _mutated(tmp_path, lambda s: s.pop("layers.1.mlp.down_proj.weight"))
    with pytest.raises(DrafterLoadError, match=r"missing tensor 'layers.1.mlp.down_proj.weight'"):
        _load(folder)


def test_unexpected_tensor_named(tmp_path):
    folder = _mutated(tmp_path, lambda s: s.update({"lm_head.weight": torch.zeros(VOCAB, 64)}))
    with pytest.raises(DrafterLoadError, match=r"unexpected tensor 'lm_head.weight'"):
        _load(folder)


def test_wrong_shape_named(tmp_path):
    folder = _mutated(tmp_path, lambda s: s.update({"layers.0.self_attn.q_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(DrafterLoadError, match=r"'layers.0.self_attn.q_proj.weight' has shape \[32, 64\]"):
        _load(folder)


def test_fc_width_mismatch_named(tmp_path):
    folder = _mutated(tmp_path, lambda s: s.update({"fc.weight": torch.zeros(64, 4 * 64)}))
    with pytest.raises(DrafterLoadError, match=r"'fc.weight'.*len\(target_layer_ids\)=3 x target hidden 64"):
        _load(folder)


@pytest.mark.parametrize("kw, pattern", [
    ({"target_hidden_size": 128}, "hidden_size 64 != target hidden size 128"),
    ({"target_vocab_size": 300}, "vocab_size 256 != target vocabulary 300"),
    ({"target_num_layers": 5}, r"target_layer_ids \[1, 3, 5\] has \[5\] >= target depth 5"),
])
def test_target_mismatch(tmp_path, kw, pattern):
    raw = zlab_config()
    del raw["num_target_layers"]
    _write(tmp_path / "d", raw)
    with pytest.raises(DrafterLoadError, match=pattern):
        _load(tmp_path / "d", **kw)


def test_bad_config_is_config_error(tmp_path):
    _write(tmp_path / "d", zlab_config())
    (tmp_path / "d" / "config.json").write_text(json.dumps(zlab_config(architectures=["Domino"])))
    with pytest.raises(DrafterConfigError, match="architectures"):
        _load(tmp_path / "d")


def test_round_trip_save_load(tmp_path):
    cfg = DrafterConfig.from_dict(zlab_config(), source="mem")
    emb, head = target_parts()
    drafter = randomize(DFlashDrafter(cfg, emb, head))
    save_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    doc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert doc["architectures"] == ["DFlashDraftModel"] and doc["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert doc["dflash_config"]["mask_token_id"] == 250 and doc["block_size"] == 16
    loaded = _load(tmp_path / "out")
    assert loaded.config == cfg
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    save_drafter(drafter, tmp_path / "bf16")
    assert _load(tmp_path / "bf16").fc.weight.dtype == torch.bfloat16
