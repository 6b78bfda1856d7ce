"""kernels/gdn_batch.py under TRITON_INTERPRET=1 (CPU, fp32): the GDN decode step of several
requests on their slots of a pooled hybrid cache. Each request's output row, its new recurrent
state and its shifted conv state are bitwise those of (a) the same request alone in the batched
kernels and (b) the one-request kernel path (``gdn_fast.fused`` on its slot's cache); other slots
are untouched; the rows are close to the pure-torch ``step_torch``; and the engine's entry point
(``gdn_batch.step``) self-checks and then takes the kernels. The interpreter must be chosen before
triton is imported: the kernels run in a child process that reports JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.kernels
ROOT = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, torch
from types import SimpleNamespace
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.hybrid import gdn_batch, gdn_fast
from ddtree_server.models.hybrid.tree import tree_meta
from tests.server.hybrid_fixtures import tiny_hybrid

torch.manual_seed(0)
model = tiny_hybrid("3gdn+attn", seed=3)
mixer, li = model.layers[1].linear_attn, 1
pool = SlotPool(lambda: model.new_cache(32), 6)
for name in ("state", "conv"):
    pool.pool(name).copy_(0.5 * torch.randn(pool.pool(name).shape))
slots = torch.tensor([3, 0, 5, 2])
proj = torch.randn(4, mixer.in_proj.out_features)
names = ("conv", "state")
fresh = lambda: {n: pool.pool(n).clone() for n in names}
start = fresh()

def run(fn):
    for n in names:
        pool.pool(n).copy_(start[n])
    out = fn()
    return out, fresh()

views = lambda g: (g["conv"][:, li], g["state"][:, li])
batched, after = run(lambda: gdn_batch.step_fused(mixer, proj, *views({n: pool.pool(n) for n in names}), slots))
ref, after_ref = run(lambda: gdn_batch.step_torch(mixer, proj, *views({n: pool.pool(n) for n in names}), slots))
res = {"alone": [], "solo_path": [], "err": float((batched - ref).abs().max()),
       "state_err": float((after["state"] - after_ref["state"]).abs().max()),
       "conv_equal": bool(torch.equal(after["conv"], after_ref["conv"])),
       "untouched": bool(torch.equal(after["state"][[1, 4]], start["state"][[1, 4]]))}
for i, s in enumerate(slots.tolist()):
    one, a1 = run(lambda: gdn_batch.step_fused(mixer, proj[i:i + 1], *views({n: pool.pool(n) for n in names}),
                                               slots[i:i + 1]))
    res["alone"].append(bool(torch.equal(one, batched[i:i + 1])) and bool(torch.equal(a1["state"][s], after["state"][s]))
                        and bool(torch.equal(a1["conv"][s], after["conv"][s])))
    ctx = SimpleNamespace(meta=tree_meta(None, 1, mixer.kernel, proj.device), mode="commit")
    solo, a2 = run(lambda: gdn_fast.fused(mixer, proj[i:i + 1], pool[s], li, ctx))
    k1 = mixer.kernel - 1
    res["solo_path"].append(bool(torch.equal(solo, batched[i:i + 1])) and bool(torch.equal(a2["state"][s], after["state"][s]))
                            and bool(torch.equal(a2["conv"][s, :, :k1], after["conv"][s, :, :k1])))
entry, a3 = run(lambda: gdn_batch.step(mixer, proj, {n: pool.pool(n) for n in names}, li, slots))
again, a4 = run(lambda: gdn_batch.step(mixer, proj, {n: pool.pool(n) for n in names}, li, slots))
res["entry"] = [bool(torch.equal(again, batched)), bool(torch.equal(a4["state"], after["state"])),
                gdn_fast.kernels_on(proj.device), float((entry - ref).abs().max())]
print(json.dumps(res))
"""


def test_batched_step_kernels_are_batch_invariant_and_match_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1", "DDTREE_KERNELS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "server"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(res["alone"]) and len(res["alone"]) == 4, res
    assert all(res["solo_path"]), res
    assert res["err"] < 1e-5 and res["state_err"] < 1e-5 and res["conv_equal"] and res["untouched"], res
    assert res["entry"][:3] == [True, True, True] and res["entry"][3] < 1e-5, res
