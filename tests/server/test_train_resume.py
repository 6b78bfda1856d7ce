"""Training in pieces on machines that keep nothing: the returnable state (train/resume.py), a run
cut by SIGTERM or SIGKILL, and the next run picking up from the carried folder alone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddtree_server.train import resume
from ddtree_server.train.data import GenSettings
from ddtree_server.train.pipeline import PipelineOptions, run
from ddtree_server.train.trainer import TrainSettings
from tests.server.train_fixtures import eval_index_or_skip, make_tiny_target

MAX_FILES = 8  # what the GPU machine returns from $OUT


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("target"), n_prompts=12)


@pytest.fixture(scope="module")
def eval_wheels():
    return eval_index_or_skip()


def _drafter():
    from ddtree_server.models.drafter.config import DrafterConfig
    from tests.server.drafter_fixtures import randomize, target_parts, zlab_config

    emb, head = target_parts()
    from ddtree_server.models.drafter.model import DFlashDrafter

    d = DFlashDrafter(DrafterConfig.from_dict(zlab_config(), source="test"), emb, head)
    randomize(d)
    return d


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_state_round_trip_and_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(resume, "PART_BYTES", 40_000)  # several parts from a small drafter
    d = _drafter()
    doc = resume.save_state(tmp_path / "s", d, {"step": 7, "next_job": 3}, tmp_path / "scratch")
    parts = doc["weights"]["parts"]
    assert len(parts) > 2 and all((tmp_path / "s" / p).stat().st_size <= 40_000 for p in parts)
    out = resume.export(tmp_path / "s", tmp_path / "zlab")
    ref = {k: v.to(torch.bfloat16) for k, v in d.state_dict().items()}
    got = _weights(out)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert json.loads((out / "config.json").read_text())["dflash_config"]["mask_token_id"] == 250
    assert resume.read_progress(tmp_path / "s")["step"] == 7
    # a second save replaces the parts: only the new ones remain
    with torch.no_grad():
        d.fc.weight.add_(1.0)
    doc2 = resume.save_state(tmp_path / "s", d, {"step": 8}, tmp_path / "scratch")
    names = sorted(p.name for p in (tmp_path / "s").iterdir())
    assert names == sorted(doc2["weights"]["parts"] + ["progress.json"])
    (tmp_path / "s" / doc2["weights"]["parts"][0]).write_bytes(b"x")
    with pytest.raises(resume.StateError, match="sha256"):
        resume.export(tmp_path / "s", tmp_path / "zlab2")


def test_a_save_cut_before_the_commit_leaves_the_old_state(tmp_path):
    d = _drafter()
    resume.save_state(tmp_path / "s", d, {"step": 1}, tmp_path / "scratch")
    before = _weights(resume.export(tmp_path / "s", tmp_path / "a"))
    with torch.no_grad():
        d.fc.weight.mul_(-1.0)

    real_replace = os.replace

    def killed(src, dst):  # the process dies between writing the new parts and the rename
        if str(dst).endswith(resume.PROGRESS):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    resume.os.replace = killed
    try:
        with pytest.raises(KeyboardInterrupt):
            resume.save_state(tmp_path / "s", d, {"step": 2}, tmp_path / "scratch")
    finally:
        resume.os.replace = real_replace
    files = list((tmp_path / "s").iterdir())
    assert len(files) <= MAX_FILES - 2  # + train_log.jsonl and run.log
    assert resume.read_progress(tmp_path / "s")["step"] == 1
    after = _weights(resume.export(tmp_path / "s", tmp_path / "b"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def _opts(tiny_target, tmp_path, work, state, **kw):
    base = dict(out_dir=tmp_path / f"out-{work}", work_dir=tmp_path / work, state_dir=tmp_path / state,
                target_dir=tiny_target, prompts_source=tiny_target / "prompts.jsonl", num_prompts=12,
                check_contamination=False, val_prompts=2, val_every_minutes=0.0,
                gen=GenSettings(max_new_tokens=12, batch_size=4, sampled_fraction=0.5),
                layers=2, layer_ids=[1, 2], block_size=4, mask_token_id=2, device="cpu",
                train=TrainSettings(steps=3, batch_size=2, anchors=4, log_every=1, warmup_steps=1))
    base.update(kw)
    return PipelineOptions(**base)


def test_second_run_on_a_fresh_machine_continues_from_the_carried_state(tiny_target, tmp_path):
    first = run(_opts(tiny_target, tmp_path, "w1", "s1"))
    state = resume.read_progress(tmp_path / "s1")
    assert state["step"] == 3 and state["complete"] and state["next_job"] == 10  # 12 prompts - 2 validation
    assert len(list((tmp_path / "s1").iterdir())) <= MAX_FILES - 1  # run.log comes from the script
    carried = shutil.copytree(tmp_path / "s1", tmp_path / "carried")  # all a fresh machine gets
    second = run(_opts(tiny_target, tmp_path, "w2", "s2", resume_from=carried, passes=0.5))
    state2 = resume.read_progress(tmp_path / "s2")
    assert second["steps"] == 6 and state2["step"] == 6
    assert state2["next_job"] == 15  # jobs 10..14: the second pass samples new answers
    recs = [torch.load(p, weights_only=True) for p in sorted((tmp_path / "w2" / "data").glob("shard_*.pt"))]
    assert sorted(j for r in recs for j in r["index"]) == list(range(10, 15))
    assert all(all(r["sampled"]) for r in recs)
    assert [r["run"] for r in state2["runs"]] == [0, 1]
    assert state2["runs"][1]["jobs"] == [10, 15] and state2["runs"][1]["start_step"] == 3
    log = [json.loads(x) for x in (tmp_path / "s2" / "train_log.jsonl").read_text().splitlines()]
    assert {r["run"] for r in log} == {0, 1}
    starts = [r for r in log if r.get("kind") == "val" and r["phase"] == "start"]
    ends = [r for r in log if r.get("kind") == "val" and r["phase"] == "end"]
    # run 1 starts from run 0's final weights (bf16 in the state: the loss agrees to rounding)
    assert starts[1]["step"] == ends[0]["step"] == 3
    assert starts[1]["val_loss"] == pytest.approx(ends[0]["val_loss"], rel=2e-2)
    assert first["sequences"] > 0 and second["sequences"] > 0


def test_resume_refuses_a_state_of_another_shape(tiny_target, tmp_path):
    run(_opts(tiny_target, tmp_path, "w1", "s1"))
    with pytest.raises(ValueError, match="config differs"):
        run(_opts(tiny_target, tmp_path, "w2", "s2", resume_from=tmp_path / "s1", layers=1, layer_ids=[1]))


def _cli(tiny_target, tmp_path, work, state, *extra):
    return [sys.executable, "-m", "ddtree_server.train", "--out", str(tmp_path / f"out-{work}"),
            "--work-dir", str(tmp_path / work), "--state-out", str(tmp_path / state),
            "--target", str(tiny_target), "--prompts", str(tiny_target / "prompts.jsonl"), "--num-prompts", "12",
            "--val-prompts", "2", "--max-new-tokens", "12", "--gen-batch-size", "4", "--layers", "2",
            "--target-layer-ids", "1,2", "--block-size", "4", "--mask-token-id", "2", "--batch-size", "2",
            "--anchors", "4", "--device", "cpu", *extra]


def _wait_for_training_save(state_dir, proc, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if resume.read_progress(state_dir)["step"] > 0:
                return
        except resume.StateError:
            pass
        time.sleep(0.2)
    raise AssertionError("no training save within the timeout")


def test_sigkill_mid_training_leaves_a_state_the_next_run_resumes(tiny_target, tmp_path, eval_wheels):
    """The machine's limit kills the process (SIGKILL) between saves: the returned folder is a
    complete state, and a run on a fresh machine continues from it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    argv = _cli(tiny_target, tmp_path, "w1", "s1", "--steps", "1000000", "--save-every-minutes", "0.005")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_for_training_save(tmp_path / "s1", proc)
        time.sleep(0.5)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    assert len(list((tmp_path / "s1").iterdir())) <= MAX_FILES - 1
    cut = resume.read_progress(tmp_path / "s1")
    assert cut["step"] > 0 and not cut["complete"]
    resume.export(tmp_path / "s1", tmp_path / "exported")  # complete parts, hashes match
    carried = shutil.copytree(tmp_path / "s1", tmp_path / "carried")
    after = run(_opts(tiny_target, tmp_path, "w2", "s2", resume_from=carried, passes=0.5))
    assert after["steps"] == cut["step"] + 3
    assert resume.read_progress(tmp_path / "s2")["runs"][-1]["start_step"] == cut["step"]


def test_a_stop_request_ends_with_a_last_save(tiny_target, tmp_path):
    """SIGTERM (should_stop) during training: the run stops at the next step, validates, saves."""
    saves: list[int] = []

    def report(kind, rec):
        if kind == "save" and rec["step"] > 0:
            saves.append(rec["step"])

    opts = _opts(tiny_target, tmp_path, "w1", "s1", save_every_minutes=0.0,
                 train=TrainSettings(steps=10_000, batch_size=2, anchors=4, log_every=1, warmup_steps=1))
    steps_seen: list[int] = []
    summary = run(opts, lambda kind, rec: (steps_seen.append(rec["step"]) if kind == "log" else None, report(kind, rec)),
                  should_stop=lambda: len(steps_seen) >= 4)
    state = resume.read_progress(tmp_path / "s1")
    assert summary["stopped_early"] and summary["steps"] == 4 and not state["complete"]
    assert state["step"] == 4 and saves == [4]
    assert json.loads((tmp_path / "out-w1" / "summary.json").read_text())["steps"] == 4


def test_sigterm_sets_the_stop_event_and_handlers_come_back():
    from ddtree_server.commands.train import _stop_on_signals

    before = signal.getsignal(signal.SIGTERM)
    with _stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.is_set()
    assert signal.getsignal(signal.SIGTERM) is before
