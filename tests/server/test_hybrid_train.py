"""train-drafter on a tiny Qwen3.5-style hybrid folder: data from our own decoding, features from
our own forward (equal to transformers' hidden states), a servable drafter at the end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ddtree_server.models.drafter.load import load_drafter
from ddtree_server.models.load import load_target
from ddtree_server.train.data import GenSettings
from ddtree_server.train.features import capture_features
from ddtree_server.train.own_target import OwnTarget
from ddtree_server.train.pipeline import PipelineOptions, run
from ddtree_server.train.trainer import TrainSettings
from tests.server.hybrid_fixtures import hf_model, random_state, tiny_config
from tests.server.hybrid_folders import SPECIALS, WORDS, write_hybrid_folder

VOCAB = len(SPECIALS) + len(WORDS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hybrid-train")
    target = write_hybrid_folder(root / "target", multimodal=True, seed=71, vocab=VOCAB)
    rng = torch.Generator().manual_seed(1)
    with open(target / "prompts.jsonl", "w") as fh:
        for _ in range(8):
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6,), generator=rng)]
            fh.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    return target


def test_features_come_from_our_forward_and_equal_transformers(folder):
    loaded = load_target(folder)
    own = OwnTarget(loaded.model, loaded.eos_token_ids)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    feats = capture_features(own, ids, [1, 2])
    cfg = tiny_config("3gdn+attn", vocab=VOCAB, eos_token_id=1, pad_token_id=1)
    hf = hf_model(cfg, random_state(cfg, 71))
    with torch.no_grad():
        ref = hf(ids, position_ids=torch.arange(12)[None].expand(2, -1), use_cache=False, output_hidden_states=True)
    want = torch.cat([ref.hidden_states[k + 1] for k in (1, 2)], dim=-1)
    assert feats.shape == (2, 12, 2 * 64) and (feats - want).abs().max() < 1e-4
    assert loaded.model.capture_layers == []


def test_train_drafter_on_hybrid_target(folder, tmp_path):
    opts = PipelineOptions(out_dir=tmp_path / "out", work_dir=tmp_path / "work", target_dir=folder,
                           prompts_source=folder / "prompts.jsonl", num_prompts=6,
                           gen=GenSettings(max_new_tokens=10, batch_size=4, sampled_fraction=0.5),
                           layers=2, layer_ids=[1, 2], block_size=4, mask_token_id=SPECIALS.index("<mask>"),
                           device="cpu", train=TrainSettings(steps=3, batch_size=2, anchors=4, log_every=1,
                                                             warmup_steps=1))
    summary = run(opts)
    assert summary["steps"] == 3 and summary["sequences"] >= 3 and math.isfinite(summary["val_loss"])
    target = load_target(folder).model
    drafter = load_drafter(tmp_path / "out", embed_tokens=target.embed_tokens, lm_head=target.lm_head,
                           target_hidden_size=64, target_num_layers=4, target_vocab_size=VOCAB)
    assert drafter.config.target_layer_ids == (1, 2)
    assert "partial_rotary_factor" not in drafter.config.rope_parameters
    with pytest.raises(ValueError, match="init random"):
        run(PipelineOptions(**{**opts.__dict__, "out_dir": tmp_path / "o2", "work_dir": tmp_path / "w2",
                               "init": "target-last"}))
