"""Benchmark runner: ar vs dflash vs ddtree (several budgets) on one Engine, batch 1.

For every prompt all methods run back to back, and the datasets take turns prompt by prompt (so a
time-limited run stays balanced across methods and datasets); each result is handed to `sink` at
once (the command appends it to a JSONL file, so an interrupted run keeps what it measured). A
warm-up generation per method runs first and is not recorded. Times come from the engine's
DecodeStats: decode excludes prefill (the DDTree reference benchmark also excludes the first draft
call, docs/ddtree.md §4.1; ours includes it), `e2e_s` is the wall time of the whole request.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

from ddtree_server.data.datasets import BenchPrompt


@dataclass(frozen=True)
class Method:
    """One decoding configuration."""

    mode: str                      # ar | dflash | ddtree | hf-generate
    budget: int | None = None      # ddtree node budget
    temperature: float = 0.0

    @property
    def name(self) -> str:
        base = f"ddtree-{self.budget}" if self.mode == "ddtree" else self.mode
        return base if self.temperature == 0 else f"{base}@T{self.temperature:g}"


@dataclass(frozen=True)
class BenchSettings:
    """What to run (tokens, seconds)."""

    budgets: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_new_tokens: int = 256
    t1_budget: int | None = 64          # the temperature-1 ddtree row (None: skip)
    hf_prompts: int = 8                 # prompts per dataset for transformers' generate() (0: skip)
    seed: int = 0
    time_budget_s: float | None = None  # stop starting new prompts this long after BenchRun.t_start
    modes: tuple[str, ...] = ("ar", "dflash", "ddtree")


def methods_for(s: BenchSettings, spec_available: bool) -> list[Method]:
    """The method list of a run (speculative ones only when the engine has a drafter)."""
    out = [Method("ar")] if "ar" in s.modes else []
    if spec_available:
        if "dflash" in s.modes:
            out.append(Method("dflash"))
        if "ddtree" in s.modes:
            out += [Method("ddtree", b) for b in s.budgets]
            if s.t1_budget is not None:
                out.append(Method("ddtree", s.t1_budget, 1.0))
    return out


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def run_one(engine, prompt_ids: list[int], m: Method, max_new_tokens: int, seed: int) -> dict:
    """One request through the engine; returns a result record (without dataset fields)."""
    from ddtree_server.engine.params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=m.temperature, seed=seed)
    ids: list[int] = []
    stats = None
    t0 = time.perf_counter()
    for ev in engine.generate(prompt_ids, params, mode=m.mode, tree_budget=m.budget):
        ids += ev.token_ids
        stats = ev.stats or stats
    e2e = time.perf_counter() - t0
    rec = {"method": m.name, "mode": m.mode, "budget": m.budget, "temperature": m.temperature,
           "prompt_tokens": len(prompt_ids), "tokens": stats.generated_tokens, "rounds": stats.decode_rounds,
           "tau": (stats.mean_acceptance_length or 1.0) if m.mode != "ar" else 1.0,
           "decode_s": stats.decode_seconds, "prefill_s": stats.prefill_seconds, "e2e_s": e2e,
           "tokens_per_s": stats.tokens_per_second or 0.0, "output_digest": _digest(ids)}
    stage = getattr(stats, "stage_seconds", None)  # optional engine field: {stage: seconds}
    if stage:
        rec["stage_seconds"] = dict(stage)
    return rec


@dataclass
class BenchRun:
    """State of one benchmark run over several datasets."""

    engine: object
    settings: BenchSettings
    sink: Callable[[dict], None]
    hf: object | None = None                      # bench.hf_baseline.HFBaseline or None
    log: Callable[[str], None] = lambda msg: None
    records: list[dict] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)  # time.monotonic() the budget counts from

    def _emit(self, rec: dict) -> None:
        self.records.append(rec)
        self.sink(rec)

    def warm_up(self, methods: list[Method], prompt_ids: list[int], longest: list[int]) -> None:
        """One short generation per method, and one full-length transformers generate() on the
        longest prompt, so that its static cache is allocated (and compiled) once at full size.
        Nothing is recorded."""
        for m in methods:
            run_one(self.engine, prompt_ids, m, 16, self.settings.seed)
        if self.hf is not None:
            self.hf.generate(longest, self.settings.max_new_tokens)

    def run(self, prompts: dict[str, list[BenchPrompt]]) -> list[dict]:
        """Run every method on every prompt (see module docstring); returns the records."""
        s, eng = self.settings, self.engine
        methods = methods_for(s, getattr(eng, "spec_available", False))
        encoded = {ds: [(p, eng.encode(p.text)) for p in ps] for ds, ps in prompts.items()}
        all_ids = [ids for ps in encoded.values() for _, ids in ps]
        self.log(f"warm-up: {', '.join(m.name for m in methods)}")
        self.warm_up(methods, all_ids[0], max(all_ids, key=len))
        t0 = self.t_start
        longest = max((len(v) for v in encoded.values()), default=0)
        # datasets take turns prompt by prompt, so a time-limited run keeps them balanced too
        order = [(ds, i) for i in range(longest) for ds in encoded if i < len(encoded[ds])]
        for ds, i in order:
            items = encoded[ds]
            p, ids = items[i]
            if s.time_budget_s is not None and time.monotonic() - t0 > s.time_budget_s:
                self.log(f"time budget reached: stopping before {ds} prompt {i}")
                return self.records
            ref = None
            for m in methods:
                rec = run_one(eng, ids, m, s.max_new_tokens, s.seed)
                rec.update(dataset=ds, prompt_id=p.id)
                if m.mode == "ar" and m.temperature == 0:
                    ref = rec["output_digest"]
                if m.temperature == 0 and ref is not None:
                    rec["same_as_ar"] = rec["output_digest"] == ref
                self._emit(rec)
            if self.hf is not None and i < s.hf_prompts:
                rec = self.hf.record(ids, s.max_new_tokens)
                rec.update(dataset=ds, prompt_id=p.id)
                self._emit(rec)
            self.log(f"{ds} {i + 1}/{len(items)} done ({time.monotonic() - t0:.0f} s)")
        return self.records
