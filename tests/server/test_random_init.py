"""target_from_config: our target of any supported family with random weights (benchmarks)."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.models.hybrid.model import HybridTarget
from ddtree_server.models.random_init import target_from_config
from ddtree_server.models.dense.target import TargetModel
from tests.server.hybrid_fixtures import tiny_config


@pytest.mark.parametrize("kind", ["hybrid-config", "hybrid-dict", "multimodal-dict", "qwen3", "llama"])
def test_random_targets_run_with_finite_logits(kind):
    from transformers import AutoConfig

    if kind == "hybrid-config":
        cfg, cls = tiny_config("mixed6"), HybridTarget
    elif kind == "hybrid-dict":
        cfg, cls = tiny_config("3gdn+attn").to_dict(), HybridTarget
    elif kind == "multimodal-dict":
        cfg, cls = {"model_type": "qwen3_5", "text_config": tiny_config("3gdn+attn").to_dict()}, HybridTarget
    else:
        cfg = AutoConfig.for_model(kind, vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        cls = TargetModel
    model = target_from_config(cfg, device="cpu", dtype="bf16", seed=1)
    assert isinstance(model, cls) and model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters())
    if cls is HybridTarget:
        gdn = next(layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn"))
        assert gdn.A_log.dtype == torch.float32 and bool((gdn.A_log.exp() >= 1).all())
    twin = target_from_config(cfg, device="cpu", dtype="bf16", seed=1)
    with torch.no_grad():
        logits, _ = model.forward(model.new_cache(64), torch.arange(20), torch.arange(20))
        again, _ = twin.forward(twin.new_cache(64), torch.arange(20), torch.arange(20))
    assert torch.isfinite(logits.float()).all() and logits.float().std() > 0
    assert torch.equal(logits, again)  # seeded


def test_unknown_family_refused():
    with pytest.raises(ValueError, match="gpt2"):
        target_from_config({"model_type": "gpt2"})


def test_random_drafter_of_a_published_shape_scaled_down():
    from ddtree_server.models.random_init import drafter_from_config
    from tests.server.drafter_fixtures import qwen36_drafter_config

    target = target_from_config(tiny_config("qwen3.6x2"), device="cpu", dtype="fp32")
    drafter = drafter_from_config(qwen36_drafter_config(), target, dtype="fp32", seed=2)
    assert drafter.config.layer_types[0] == "sliding_attention" and not any(p.is_meta for p in drafter.parameters())
    logits = drafter.propose(drafter.new_cache(64), torch.randn(20, 5 * 64), 3, 20)
    assert logits.shape == (15, 260) and torch.isfinite(logits).all()
