"""train-drafter end to end on CPU with a tiny random Llama target and a word-level tokenizer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from ddtree_server.cli import app
from ddtree_server.models.drafter.load import load_drafter
from ddtree_server.train.data import GenSettings
from ddtree_server.train.pipeline import PipelineOptions, run
from ddtree_server.train.trainer import TrainSettings
from tests.server.train_fixtures import eval_index_or_skip, make_tiny_target


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def eval_wheels():
    return eval_index_or_skip()


def _opts(tiny_target, tmp_path, **kw):
    base = dict(out_dir=tmp_path / "out", work_dir=tmp_path / "work", target_dir=tiny_target,
                prompts_source=tiny_target / "prompts.jsonl", num_prompts=6, check_contamination=False,
                gen=GenSettings(max_new_tokens=12, batch_size=4, sampled_fraction=0.5),
                layers=2, layer_ids=[1, 2], block_size=4, mask_token_id=2, device="cpu",
                train=TrainSettings(steps=3, batch_size=2, anchors=4, log_every=1, warmup_steps=1))
    base.update(kw)
    return PipelineOptions(**base)


def test_three_steps_then_load(tiny_target, tmp_path):
    summary = run(_opts(tiny_target, tmp_path))
    assert summary["steps"] == 3 and 3 <= summary["sequences"] <= 6  # responses holding the mask id are dropped
    records = [json.loads(x) for x in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert math.isfinite(summary["val_loss"])
    emb = torch.nn.Embedding(64, 64)
    drafter = load_drafter(tmp_path / "out", embed_tokens=emb, lm_head=torch.nn.Linear(64, 64, bias=False),
                           target_hidden_size=64, target_num_layers=4, target_vocab_size=64)
    assert drafter.config.target_layer_ids == (1, 2) and drafter.config.mask_token_id == 2
    assert drafter.fc.weight.dtype == torch.bfloat16 and tuple(drafter.fc.weight.shape) == (64, 128)


def test_cli_resume_continues(tiny_target, tmp_path, eval_wheels):
    run(_opts(tiny_target, tmp_path))
    args = ["train-drafter", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
            "--target", str(tiny_target), "--prompts", str(tiny_target / "prompts.jsonl"),
            "--num-prompts", "6", "--max-new-tokens", "12", "--gen-batch-size", "4", "--sampled-fraction", "0.5",
            "--layers", "2", "--target-layer-ids", "1,2", "--block-size", "4", "--mask-token-id", "2",
            "--steps", "2", "--batch-size", "2", "--anchors", "4", "--device", "cpu", "--resume"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 5  # 3 before + 2 resumed


def test_cli_refuses_oversized_drafter(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="max-mb"):
        run(_opts(tiny_target, tmp_path, max_mb=0.01))


def test_split_and_join_round_trip(tmp_path):
    from ddtree_server.train.split import join_parts, split_large

    blob = torch.randint(0, 255, (2500,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    (tmp_path / "model.safetensors").write_bytes(blob)
    (tmp_path / "config.json").write_text("{}")
    parts = split_large(tmp_path, 1000)
    assert [p.name for p in parts] == [f"model.safetensors.part0{i}" for i in range(3)]
    assert not (tmp_path / "model.safetensors").exists()
    join_parts(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == blob
    (tmp_path / "config.json").write_text("{ }")
    with pytest.raises(ValueError, match="config.json"):
        join_parts(tmp_path)


def test_init_from_existing_drafter(tiny_target, tmp_path):
    run(_opts(tiny_target, tmp_path))
    first = load_drafter(tmp_path / "out", embed_tokens=torch.nn.Embedding(64, 64),
                         lm_head=torch.nn.Linear(64, 64, bias=False), target_hidden_size=64,
                         target_num_layers=4, target_vocab_size=64)
    summary = run(_opts(tiny_target, tmp_path, out_dir=tmp_path / "out2", init_from=tmp_path / "out",
                        train=TrainSettings(steps=1, batch_size=2, anchors=4, lr=1e-9, warmup_steps=1)))
    assert summary["init"] == str(tmp_path / "out")
    second = load_drafter(tmp_path / "out2", embed_tokens=torch.nn.Embedding(64, 64),
                          lm_head=torch.nn.Linear(64, 64, bias=False), target_hidden_size=64,
                          target_num_layers=4, target_vocab_size=64)
    torch.testing.assert_close(second.fc.weight.float(), first.fc.weight.float(), atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="config differs"):
        run(_opts(tiny_target, tmp_path, out_dir=tmp_path / "out3", init_from=tmp_path / "out", layers=1,
                  layer_ids=[1]))


def test_two_workers_shard_prompts_and_train_on_both(tiny_target, tmp_path):
    """Two data workers answer disjoint prompt halves (--prompt-shard); training reads both
    folders (--extra-data) and picks up shards written while it runs."""
    from ddtree_server.train import data

    a = run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wa", prompt_shard=(0, 2), generate_only=True))
    b = run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wb", prompt_shard=(1, 2), generate_only=True))
    assert not (tmp_path / "out" / "summary.json").exists()
    idx = [i for w in ("wa", "wb") for p in (tmp_path / w / "data").glob("shard_*.pt")
           for i in torch.load(p, weights_only=True)["index"]]
    assert sorted(idx) == list(range(6))  # prompts 0, 2, 4 and 1, 3, 5: disjoint, together all
    summary = run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wa", prompt_shard=(0, 2),
                        extra_data=[tmp_path / "wb" / "data"]))
    assert summary["sequences"] == a["sequences"] + b["sequences"]
    seen: set[str] = set()
    assert len(data.load_sequences(tmp_path / "wb" / "data", 64, seen)) == b["sequences"]
    assert data.load_sequences(tmp_path / "wb" / "data", 64, seen) == []  # nothing new since
    with pytest.raises(ValueError, match="other settings"):  # a folder stays bound to its shard
        run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wb", prompt_shard=(0, 2), generate_only=True))


def test_prompt_order_mixes_lengths_across_windows():
    from ddtree_server.train.data import _batch_order

    todo = [(i, [0] * (100 - i)) for i in range(40)]  # given order: longest first
    order = _batch_order(todo, [False] * 40, batch_size=2)
    assert [i for i, _ in order[:8]] == [7, 6, 5, 4, 3, 2, 1, 0]  # sorted inside the first window only
    assert {i for i, _ in order[:8]} == set(range(8))


def test_cli_rejects_bad_prompt_shard(tiny_target, tmp_path):
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "o"), "--target", str(tiny_target),
                                      "--steps", "1", "--prompt-shard", "2/2"])
    assert result.exit_code == 2 and "0 <= I < N" in result.output


def test_trainer_takes_sequences_that_arrive_while_training(tiny_target):
    from transformers import AutoModelForCausalLM

    from ddtree_server.train import build, checkpoint
    from ddtree_server.train.data import Sequence
    from ddtree_server.train.trainer import Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval().requires_grad_(False)
    cfg = build.new_drafter_config(model.config, num_layers=1, layer_ids=[1, 2], block_size=4, mask_token_id=2)
    drafter = checkpoint.new_or_resumed(cfg, model.get_input_embeddings(), model.get_output_embeddings(),
                                        torch.device("cpu"))
    seq = Sequence(torch.tensor([3, 4, 6, 7, 8, 9, 10, 11, 1]), 3)
    arrivals = [[seq, seq], []]
    trainer = Trainer(drafter, model, [seq], TrainSettings(steps=3, batch_size=1, anchors=2, warmup_steps=1))
    trainer.more, trainer.refresh_s = (lambda: arrivals.pop(0) if arrivals else []), 0.0
    trainer.run()
    assert len(trainer.seqs) == 3 and trainer.step == 3


def test_extra_data_folders_are_checked(tiny_target, tmp_path):
    from ddtree_server.train.data import check_extra_folder

    run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wb", prompt_shard=(1, 2), generate_only=True))
    own = tmp_path / "wa" / "data"
    with pytest.raises(ValueError, match="no such directory"):
        check_extra_folder(tmp_path / "nope", own)
    with pytest.raises(ValueError, match="its data folder is"):
        check_extra_folder(tmp_path / "wb", own)
    with pytest.raises(ValueError, match="own data folder"):
        check_extra_folder(tmp_path / "wb" / "data", tmp_path / "wb" / "data")
    (tmp_path / "pending").mkdir()
    check_extra_folder(tmp_path / "pending", own)  # a worker that has not started yet
    doc = json.loads((tmp_path / "wb" / "data" / "manifest.json").read_text())
    check_extra_folder(tmp_path / "wb" / "data", own, doc["target"], (0, 2))
    with pytest.raises(ValueError, match="made for target"):
        check_extra_folder(tmp_path / "wb" / "data", own, "other.gguf:1", (0, 2))
    with pytest.raises(ValueError, match="same prompt shard"):
        check_extra_folder(tmp_path / "wb" / "data", own, doc["target"], (1, 2))
    with pytest.raises(ValueError, match="no such directory"):  # the pipeline checks before loading
        run(_opts(tiny_target, tmp_path, work_dir=tmp_path / "wa", extra_data=[tmp_path / "typo"]))


@pytest.mark.parametrize("extra,text", [
    (["--gen-engine", "vllm"], "--gen-engine"),
    (["--passes", "0"], "--passes"),
    (["--bucket", "0"], "--bucket"),
    (["--resume-from", "."], "not a state folder"),
])
def test_cli_rejects_bad_piece_options(tiny_target, tmp_path, extra, text):
    result = CliRunner().invoke(app, ["train-drafter", "--out", str(tmp_path / "o"), "--target", str(tiny_target),
                                      "--steps", "1", *extra])
    assert result.exit_code == 2 and text in result.output, result.output
