"""Stages of the batch-1 device round (engine/batch/solo_round.py) for `bench --random-shape`.

* ``device_round_B``: everything after the drafter of one greedy DDTree round of budget B (top-K,
  device tree, verify inputs, target forward, walk, KV commit, feature rows, the one copy back;
  one CUDA-graph replay on CUDA) on fixed draft logits, the cache rewound to the context each call;
* ``round_ddtree_B_device`` / ``round_ddtree_B_host``: one whole decode round of the batch engine's
  step runner for one request in slot 0 (drafter proposal, then the device round, or today's host
  round: heap tree, tree inputs, verify, host walk and ``KVCache.keep``), the request advancing.

Only where the engine's target is graphed and dense (``runner.solo``); the rounds run last, since
they use the runner's slot cache (the target's graphs re-bind when the cache changes).
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor


def device_round_stages(engine, budgets, cache, logits: Tensor, s: int, bonus: int, run, rewind) -> None:
    """``device_round_B`` for every budget B: ``run(name, fn, setup, rows=...)`` times it."""
    from ddtree_server.engine.batch.solo_round import SoloRound
    from ddtree_server.engine.sampling import SamplingParams

    if engine.batch.runner.solo is None:
        return
    solo = SoloRound(engine.target, capture=engine.batch.runner.solo.capture)
    greedy = SamplingParams(max_tokens=1)
    for b in budgets:
        req = SimpleNamespace(mode="ddtree", params=greedy, processor=None, bonus=bonus, s=s, budget=b)
        run(f"device_round_{b}", lambda req=req: solo.run(cache, logits, req, req.budget),
            lambda: rewind(cache, s), rows=b + 1)
    rewind(cache, s)


def runner_round_stages(engine, budgets, prompt: list[int], run) -> None:
    """``round_ddtree_B_device`` and ``round_ddtree_B_host``: ``runner.round`` of one request."""
    from ddtree_server.engine.sampling import SamplingParams

    batch = engine.batch
    runner, solo = batch.runner, batch.runner.solo
    if solo is None:
        return
    try:
        for b in budgets:
            for name, device in ((f"round_ddtree_{b}_device", solo), (f"round_ddtree_{b}_host", None)):
                runner.solo = device
                req = engine.make_request(prompt, SamplingParams(max_tokens=1 << 30, ignore_eos=True),
                                          mode="ddtree", tree_budget=b)
                req.slot = 0   # the runner alone (no scheduler, no stop checks: no tokenizer needed)
                runner.reset(0)
                runner.prefill(req)
                run(name, lambda req=req: runner.round([req]), rows=b + 1, kv=req.s)
    finally:
        runner.solo = solo
