"""The z-lab drafters of the Qwen3.5 / Qwen3.6 27B targets: published configs parse, a scaled-down
z-lab folder loads against a tiny hybrid target, and speculative decoding with it (random drafter
weights, CUDA-graph static paths of target and drafter) gives plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.graphs import GraphedDrafter
from ddtree_server.models.drafter.load import load_drafter, save_drafter
from ddtree_server.models.hybrid.config import HybridConfig
from ddtree_server.models.hybrid.graphs import GraphedHybrid
from ddtree_server.models.hybrid.shapes import published
from tests.server.drafter_fixtures import qwen36_drafter_config, randomize
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, ByteTokenizer


@pytest.mark.parametrize("name", ["qwen3.6-27b", "qwen3.5-27b"])
def test_published_configs_parse(name):
    target, drafter = published(name)
    cfg = DrafterConfig.from_dict(drafter)
    t = HybridConfig.from_any(target)
    assert (t.num_hidden_layers, t.hidden_size, len(t.gdn_layers), len(t.attn_layers)) == (64, 5120, 48, 16)
    assert cfg.target_layer_ids == (1, 16, 31, 46, 61) and cfg.block_size == 16 and cfg.mask_token_id == 248070
    assert cfg.context_width == 5 * 5120 and max(cfg.target_layer_ids) < t.num_hidden_layers
    kinds = [cfg.attention_kind(i) for i in range(5)]
    if name == "qwen3.6-27b":
        assert kinds == [(True, 2048)] * 4 + [(False, None)]
    else:
        assert kinds == [(False, None)] * 5


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    return tiny_hybrid("qwen3.6x2", seed=41)


def test_scaled_zlab_folder_loads_and_decodes_exactly(hybrid, tmp_path):
    raw = qwen36_drafter_config()
    src = randomize(DFlashDrafter(DrafterConfig.from_dict(raw), hybrid.embed_tokens, hybrid.lm_head), seed=3, scale=0.1)
    folder = save_drafter(src, tmp_path / "zlab", dtype=torch.float32)
    cfg = hybrid.config
    drafter = load_drafter(folder, embed_tokens=hybrid.embed_tokens, lm_head=hybrid.lm_head,
                           target_hidden_size=cfg.hidden_size, target_num_layers=cfg.num_hidden_layers,
                           target_vocab_size=cfg.vocab_size)
    assert drafter.config.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in (list(b"Hello there, general"), list(b"1+1=2, 2+2=")):
        ref = _tokens(Engine(hybrid, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=128), prompt, params, "ar")
        for target, d in ((hybrid, drafter), (GraphedHybrid(hybrid, capture=False), GraphedDrafter(drafter, capture=False))):
            engine = Engine(target, ByteTokenizer(), d, eos_token_ids=[EOS], max_model_len=128)
            assert engine.block_size == 16 and engine.default_mode == "ddtree"
            for mode, budget in (("dflash", None), ("ddtree", 15), ("ddtree", 64)):
                assert _tokens(engine, prompt, params, mode, budget) == ref, (type(target).__name__, mode, budget)


def _tokens(engine, ids, params, mode, budget=None):
    return [t for ev in engine.generate(ids, params, mode=mode, tree_budget=budget) for t in ev.token_ids]
