"""One `train-drafter` run, stage by stage (train/pipeline.py describes the folders and choices).

Order: load the target -> clean prompts (contamination check) -> start state (carried state,
--init-from or a fresh init) -> greedy validation answers -> validation at the start -> first
save (so the returned state is valid from the first minute on) -> training data from the cursor
until the generation deadline -> save (cursor advanced) -> training with periodic validation and
saves -> last validation and save. Every save writes the z-lab folder, the same-machine
train_state.pt and, with a state folder, the returnable state (train/resume.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch

from ddtree_server.train import build, checkpoint, data, resume
from ddtree_server.train.inputs import (RESERVE_S, PipelineOptions, clean_prompts, eos_ids, load_hf_target,
                                       pick_mask_token, resolve_device)
from ddtree_server.train.trainer import Trainer, evaluate


class Session:
    """State of one run; `run()` does the work and returns the summary."""

    def __init__(self, opts: PipelineOptions, report: Callable[[str, dict], None], should_stop: Callable[[], bool]):
        self.o, self.report, self.should_stop = opts, report, should_stop
        self.t0 = time.monotonic()
        self.deadline = self.t0 + opts.max_minutes * 60 if opts.max_minutes else None
        self.out, self.work = Path(opts.out_dir), Path(opts.work_dir)
        self.log_path = Path(opts.state_dir or opts.out_dir) / "train_log.jsonl"
        self.progress: dict = {}
        self.run_rec: dict = {}

    # ------------------------------------------------------------------ helpers
    def log(self, rec: dict) -> None:
        rec = {"run": self.run_rec.get("run", 0), **rec}
        with open(self.log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(rec) + "\n")
        self.report("log" if rec.get("kind") == "train" else "record", rec)

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def _validate(self, step: int, val: list[data.Sequence], settings, phase: str) -> dict:
        metrics = evaluate(self.drafter, self.model, val, settings) if val else {}
        if metrics:
            self.log({"kind": "val", "phase": phase, "step": step,
                      "elapsed_s": round(time.monotonic() - self.t0, 1), **metrics})
        return metrics

    def _save(self, trainer_or_none, step: int, complete: bool = False) -> None:
        state_path = self.work / "train_state.pt"
        if trainer_or_none is not None:
            checkpoint.save_checkpoint(trainer_or_none, self.out, state_path)
        if self.o.state_dir is not None:
            self.progress.update(step=step, complete=complete, rng=resume.rng_state(),
                                 runs=self.progress.get("runs_before", []) + [self.run_rec])
            doc = {k: v for k, v in self.progress.items() if k != "runs_before"}
            resume.save_state(self.o.state_dir, self.drafter, doc, self.work / "scratch")
        self.report("save", {"step": step})

    # ------------------------------------------------------------------ stages
    def _start_state(self, tid: str) -> int:
        """Initialise the drafter (carried state, --init-from or fresh); returns the job cursor."""
        o = self.o
        before: dict = {}
        if o.resume_from is not None:
            before = resume.read_progress(o.resume_from)
            if before.get("target") not in (None, tid):
                raise ValueError(f"{o.resume_from}: state of target {before.get('target')!r}, not {tid!r}")
            build.load_weights(self.drafter, resume.export(o.resume_from, self.work / "resume-in"), self.model)
            resume.set_rng_state(before.get("rng"))
            src = Path(o.resume_from) / "train_log.jsonl"
            if src.exists() and not self.log_path.exists() and src.resolve() != self.log_path.resolve():
                shutil.copyfile(src, self.log_path)
            self.report("stage", {"stage": "resumed state", "from": str(o.resume_from), "step": before.get("step")})
        elif o.init_from is not None:
            build.load_weights(self.drafter, o.init_from, self.model)
            self.report("stage", {"stage": "initialised", "from": str(o.init_from)})
        else:
            build.init_drafter(self.drafter, self.model, o.init, seed=o.train.seed)
        runs = list(before.get("runs", []))
        self.progress = {"target": tid, "seed": o.gen.seed, "step": int(before.get("step", 0)),
                         "next_job": int(before.get("next_job", 0)), "runs_before": runs,
                         "init": str(o.init_from) if o.init_from else before.get("init", o.init),
                         "gen_settings": asdict(o.gen), "train_settings": asdict(o.train)}
        self.run_rec = {"run": len(runs), "start_step": self.progress["step"], "jobs": [self.progress["next_job"]] * 2}
        return self.progress["next_job"]

    def _generate(self, tok, texts, folder, s, start, max_jobs, deadline, encoded=None) -> data.GenResult:
        return data.generate_shards(
            self.model, tok, texts, folder, s, eos_ids=eos_ids(self.model, tok), mask_token_id=self.mask_id,
            target_id=self.tid, deadline=deadline, shard=self.o.prompt_shard if folder.name == "data" else None,
            start_job=start, max_jobs=max_jobs, report=self.report, should_stop=self.should_stop, encoded=encoded)

    def run(self) -> dict:
        o = self.o
        dev = resolve_device(o.device)
        torch.manual_seed(o.train.seed)
        for extra in o.extra_data:  # before the slow steps; the target id is checked once known
            data.check_extra_folder(extra, self.work / "data")
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.report("stage", {"stage": "load target", "device": str(dev)})
        self.model, tok, self.tid = load_hf_target(o, dev)
        for extra in o.extra_data:
            data.check_extra_folder(extra, self.work / "data", self.tid, o.prompt_shard)
        self.mask_id = pick_mask_token(tok, o.mask_token_id)
        config = build.new_drafter_config(self.model.config, num_layers=o.layers, layer_ids=o.layer_ids,
                                          block_size=o.block_size, mask_token_id=self.mask_id,
                                          intermediate_size=o.intermediate_size)
        self.drafter = checkpoint.new_or_resumed(config, self.model.get_input_embeddings(),
                                                 self.model.get_output_embeddings(), dev)
        size = build.drafter_bytes(self.drafter)
        if size > o.max_mb * 1e6:
            raise ValueError(f"drafter would be {size / 1e6:.1f} MB in bf16 > --max-mb {o.max_mb}")

        prompts, dropped, refs = clean_prompts(o)
        n_val = min(o.val_prompts, len(prompts) // 5)  # reserved even by a data-only worker (same pool)
        val_texts, pool = prompts[len(prompts) - n_val:], prompts[:len(prompts) - n_val][:o.num_prompts]
        self.report("stage", {"stage": "prompts", "pool": len(pool), "val": len(val_texts),
                              "contaminated_dropped": len(dropped), "reference_texts": refs})
        start = self._start_state(self.tid)
        self.progress["contamination"] = {"reference_texts": refs, "dropped": dropped[:50], "n_dropped": len(dropped)}
        encoded = data.encode_prompts(tok, pool, o.gen.max_prompt_tokens)
        settings = o.train
        val: list[data.Sequence] = []
        if n_val and not o.generate_only:
            vs = replace(o.gen, sampled_fraction=0.0)
            self._generate(tok, val_texts, self.work / "val", vs, 0, None, None)
            val = data.load_sequences(self.work / "val", o.max_seq_len)
            start_metrics = self._validate(self.progress["step"], val, settings, "start")
            self.run_rec["val_start"] = start_metrics.get("val_tau")
            self._save(None, self.progress["step"])

        gen_deadline = None
        if o.gen_minutes:
            gen_deadline = self.t0 + o.gen_minutes * 60
        if self.deadline is not None and not o.generate_only:
            gen_deadline = min(gen_deadline or self.deadline, self.deadline - RESERVE_S - 60)
        max_jobs = max(1, round(o.passes * len(encoded))) if encoded else 0
        res = self._generate(tok, pool, self.work / "data", o.gen, start, max_jobs, gen_deadline or self.deadline,
                             encoded=encoded)
        self.progress["next_job"] = res.next_job
        self.run_rec.update(jobs=[start, res.next_job], gen_seconds=round(res.seconds, 1), engine=res.engine,
                            gen_new_tokens=res.new_tokens, gen_tokens_per_s=round(res.tokens_per_s, 1))
        self.log({"kind": "gen", "step": self.progress["step"], "jobs": [start, res.next_job],
                  "jobs_done": res.jobs_done, "sequences": res.sequences, "new_tokens": res.new_tokens,
                  "seconds": round(res.seconds, 1), "tokens_per_s": round(res.tokens_per_s, 1), "engine": res.engine})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if o.generate_only:
            self.report("stage", {"stage": "done", "sequences": res.sequences, "gen_seconds": round(res.seconds, 1)})
            return {"target": self.tid, "prompts": len(pool), "sequences": res.sequences,
                    "gen_seconds": round(res.seconds, 1), "next_job": res.next_job}
        self._save(None, self.progress["step"])  # the cursor has moved
        return self._train(tok, val, config, size, len(pool), res, dropped)

    def _train(self, tok, val, config, size, n_prompts, res, dropped) -> dict:
        o = self.o
        seen: set[str] = set()

        def arrived() -> list[data.Sequence]:  # shards of the other workers not loaded yet
            return [q for d in o.extra_data for q in data.load_sequences(d, o.max_seq_len, seen)]

        seqs = data.load_sequences(self.work / "data", o.max_seq_len, seen) + arrived()
        settings = o.train
        if self.deadline is not None:
            settings = replace(settings, max_minutes=max(0.1, (self.left_s() - RESERVE_S) / 60))
        trainer = Trainer(self.drafter, self.model, seqs, settings)
        trainer.step = self.progress["step"]
        if o.extra_data:
            trainer.more = arrived
        state_path = self.work / "train_state.pt"
        if state_path.exists() and (o.resume or o.resume_from is not None):
            saved = torch.load(state_path, map_location="cpu", weights_only=True)
            if o.resume_from is None or int(saved["step"]) == self.progress["step"]:
                checkpoint.load_checkpoint(trainer, state_path)
                self.report("stage", {"stage": "resumed", "step": trainer.step, "optimizer": True})
        self.progress["step"] = self.run_rec["start_step"] = trainer.step
        self.report("stage", {"stage": "train", "sequences": len(seqs), "val": len(val),
                              "budget_min": round(settings.max_minutes, 2), "steps": settings.steps})
        t_train = time.monotonic()

        def on_log(rec: dict) -> None:
            self.log({"kind": "train", **rec})

        def on_save(step: int) -> None:
            self.run_rec.update(end_step=step, train_seconds=round(time.monotonic() - t_train, 1))
            self._save(trainer, step)

        last = trainer.run(on_log, on_save, o.save_every_minutes * 60,
                           on_val=lambda step: self._validate(step, val, settings, "train"),
                           val_every_s=o.val_every_minutes * 60, should_stop=self.should_stop)
        train_s = time.monotonic() - t_train
        metrics = self._validate(trainer.step, val, settings, "end")
        stopped = self.should_stop()
        self.progress["val"] = metrics
        self.run_rec.update(end_step=trainer.step, train_seconds=round(train_s, 1), val_end=metrics.get("val_tau"),
                            sequences=len(trainer.seqs), stopped=stopped)
        self._save(trainer, trainer.step, complete=not stopped)
        summary = {
            "target": self.tid, "mask_token_id": self.mask_id, "mask_token": tok.convert_ids_to_tokens(self.mask_id),
            "drafter_config": config.to_dict(), "drafter_bytes_bf16": size, "init": self.progress.get("init"),
            "prompts": n_prompts, "sequences": len(trainer.seqs), "val_sequences": len(val),
            "tokens": int(sum(len(s.ids) for s in trainer.seqs)), "gen_seconds": round(res.seconds, 1),
            "gen_tokens_per_s": round(res.tokens_per_s, 1), "gen_engine": res.engine, "jobs": self.run_rec["jobs"],
            "contaminated_dropped": len(dropped), "extra_data": [str(d) for d in o.extra_data],
            "train_seconds": round(train_s, 1), "steps": trainer.step, "last_log": last, **metrics,
            "stopped_early": stopped, "runs": self.progress.get("runs_before", []) + [self.run_rec],
            "gen_settings": asdict(o.gen), "train_settings": asdict(settings), "device": str(self.drafter.fc.weight.device),
            "torch": torch.__version__, "total_seconds": round(time.monotonic() - self.t0, 1),
        }
        if torch.cuda.is_available() and self.drafter.fc.weight.is_cuda:
            summary["gpu"] = torch.cuda.get_device_name(self.drafter.fc.weight.device)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.report("stage", {"stage": "done", **{k: metrics.get(k) for k in ("val_loss", "val_tau")}})
        return summary
