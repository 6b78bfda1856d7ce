"""Per-stage time split of one speculative round (docs/ddtree.md §2.1, §2.6): draft, tree build,
verify, and the rest (walk, KV compaction, tensor set-up, stop checks = "commit").

Measured in a separate profiling pass, never in the timed runs: the engine's drafter `propose`,
target `forward` and the decode module's tree builders are wrapped with CUDA-synchronised timers
for the duration of one request, then restored. The first target forward of the request is the
prefill and is excluded. commit = decode time - draft - tree - verify. Synchronising after every
stage adds a little time; the split is for proportions, the timed runs give the speeds. Batch-1
greedy ddtree rounds on a graphed dense target run tree build, verify and walk + commit as one
device round (engine/batch/solo_round.py): its whole time counts as verify (tree build 0).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ddtree_server.bench.timing import sync


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.totals = {"draft": 0.0, "tree": 0.0, "verify": 0.0}
        self.forwards = 0

    def wrap(self, stage: str, fn, skip_first: bool = False):
        def timed(*args, **kwargs):
            if skip_first:
                self.forwards += 1
                if self.forwards == 1:
                    return fn(*args, **kwargs)
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.totals[stage] += time.perf_counter() - t0
            return out
        return timed


@contextmanager
def _instrumented(engine, timer: _Timer):
    from ddtree_server.engine import decode

    saved = {"dd": decode.ddtree_builder, "df": decode.dflash_builder}
    target, drafter = engine.target, engine.drafter
    had_fwd, had_prop = "forward" in vars(target), "propose" in vars(drafter)
    orig_fwd, orig_prop = target.forward, drafter.propose
    target.forward = timer.wrap("verify", orig_fwd, skip_first=True)
    drafter.propose = timer.wrap("draft", orig_prop)
    decode.ddtree_builder = timer.wrap("tree", saved["dd"])
    decode.dflash_builder = timer.wrap("tree", saved["df"])
    solo = engine.batch.runner.solo
    if solo is not None:
        solo.run = timer.wrap("verify", solo.run)
    try:
        yield
    finally:
        decode.ddtree_builder, decode.dflash_builder = saved["dd"], saved["df"]
        if solo is not None:
            del solo.run
        if had_fwd:
            target.forward = orig_fwd
        else:
            del target.forward
        if had_prop:
            drafter.propose = orig_prop
        else:
            del drafter.propose


def stage_split(engine, prompt_ids: list[int], mode: str, budget: int | None, max_new_tokens: int) -> dict:
    """Mean milliseconds per round of each stage for one greedy request, plus rounds and tau.
    Raises ValueError when the engine has no drafter."""
    from ddtree_server.bench.runner import Method, run_one

    if engine.drafter is None:
        raise ValueError("the stage split needs a drafter (dflash / ddtree)")
    timer = _Timer(engine.device)
    with _instrumented(engine, timer):
        rec = run_one(engine, prompt_ids, Method(mode, budget), max_new_tokens, 0)
    rounds = max(1, rec["rounds"])
    parts = {k: v * 1000 / rounds for k, v in timer.totals.items()}
    parts["commit"] = max(0.0, rec["decode_s"] * 1000 / rounds - sum(parts.values()))
    return {"mode": mode, "budget": budget, "rounds": rec["rounds"], "tau": rec["tau"],
            "ms_per_round": {k: round(v, 3) for k, v in parts.items()},
            "round_ms": round(rec["decode_s"] * 1000 / rounds, 3)}
