"""The kernel path of the engine (models/dense/fast.py) against the SDPA path, on CPU under TRITON_INTERPRET=1
with DDTREE_KERNELS=1 (fp32): the target's eager and graph-ready static forwards, the graphed
drafter, and exactness (ar == dflash == ddtree token for token, equal to the SDPA path's ar).

The Triton interpreter must be chosen before triton is imported: the checks run in one child process
for the module (interp_child.py). ``DDTREE_KERNELS`` is read at every forward, so the child switches it
between the reference (0) and the kernel path (1)."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.kernels import runtime
from tests.server.interp_child import module_child

_CHILD = r"""
import os, torch
from tests.server.interp_fast import install
install()
torch.set_num_threads(1)
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.drafter.graphs import GraphedDrafter
from ddtree_server.models.dense.graphs import GraphedTarget
from tests.server.test_drafter_graphs import SLIDING, _compare, _drafter
from tests.server.test_graphs import _tree_mask
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter, tiny_target

def kernels(flag):
    os.environ["DDTREE_KERNELS"] = flag

def target():
    out = {"target": []}
    model = tiny_target(layers=3)   # the fewest that hold capture layers 0 and 2 (drafter layers 1, 2)
    model.capture_layers = [0, 2]
    graphed = GraphedTarget(model, capture=False)
    ref_c, graph_c, eager_c = model.new_cache(200), graphed.new_cache(200), model.new_cache(200)
    s = 12
    steps = [(s, None), (1, None), (5, 1), (10, 2), (3, None)]
    for step, (n, tree) in enumerate(steps):
        pos0 = 0 if step == 0 else s
        ids = (torch.arange(n) * 7 + step) % VOCAB
        mask = _tree_mask(n, tree) if tree is not None else None
        pos = (mask.sum(-1) - 1 if mask is not None else torch.arange(n)) + pos0
        kernels("0")
        want, fwant = model.forward(ref_c, ids, pos, mask)
        kernels("1")
        got, fgot = graphed.forward(graph_c, ids, pos, mask)
        eag, feag = model.forward(eager_c, ids, pos, mask)
        if step:
            keep = [0] + [i for i in range(1, n) if i % 3 == 0]
            for c in (ref_c, graph_c, eager_c):
                c.keep(s, keep)
            s += len(keep)
        out["target"].append({"n": n, "graphed": (got - want).abs().max().item(), "eager": (eag - want).abs().max().item(),
                              "feats": max((fgot - fwant).abs().max().item(), (feag - fwant).abs().max().item()),
                              "cache": max((c.k[:, :, :s] - ref_c.k[:, :, :s]).abs().max().item() for c in (graph_c, eager_c))})
    out["graph_keys"] = sorted({k[:2] for k in graphed._static})
    return out

def tokens(modes):
    model = tiny_target(layers=3)   # the fewest that hold capture layers 0 and 2 (drafter layers 1, 2)
    tok, prompt, sp = ByteTokenizer(), list(b"kernel path"), SamplingParams(max_tokens=16, ignore_eos=True)
    model.capture_layers = []
    kernels("0")
    ref = [t for ev in Engine(model, tok, max_model_len=120, eos_token_ids=[EOS]).generate(prompt, sp) for t in ev.token_ids]
    kernels("1")
    out = {"tokens": {}}
    for mode, budget in modes:
        drafter = OracleDrafter(len(prompt), ref, vocab=VOCAB, hidden=64, layer_ids=[1, 2], block_size=8)
        eng = Engine(GraphedTarget(model, capture=False), tok, drafter, max_model_len=120, eos_token_ids=[EOS])
        got = [t for ev in eng.generate(prompt, sp, mode=mode, tree_budget=budget) for t in ev.token_ids]
        out["tokens"][f"{mode}/{budget}"] = got == ref
    return out

def drafter():
    kernels("1")
    d = _drafter()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    graphed_d = GraphedDrafter(d, capture=False)
    _compare(graphed_d, d, "cpu", 1e-5, 96)  # raises on a mismatch
    after = d.state_dict()
    q0 = d.layers[0].self_attn.q_proj.weight
    out = {"drafter": {"enabled": graphed_d.enabled, "keys": sorted(graphed_d._static),
                       "fused": [f is not None for f in graphed_d._fused],
                       "weights_kept": all(torch.equal(before[k], after[k]) for k in before),
                       "shared_storage": q0.data_ptr() == graphed_d._fused[0][0].data_ptr()}}
    slide = _drafter(**SLIDING)  # a sliding-window (causal) layer, then a full one
    graphed_s = GraphedDrafter(slide, capture=False)
    _compare(graphed_s, slide, "cpu", 1e-5, 96)
    out["drafter"]["sliding"] = {"enabled": graphed_s.enabled, "kinds": slide.kinds, "keys": sorted(graphed_s._static)}
    return out

PARTS = {"target": target, "drafter": drafter, "tokens": tokens}
"""


child = module_child(_CHILD, skip_without="triton")   # one interpreter child for the module's parts


@pytest.mark.kernels
def test_target_kernel_path_equals_sdpa(child):
    report = child("target")
    rows = report["target"]
    assert [r["n"] for r in rows] == [12, 1, 5, 10, 3]
    for r in rows:
        assert max(r["graphed"], r["eager"], r["feats"], r["cache"]) < 1e-4, r
    # graphs keyed by the bucket alone: kv_len 0 (the kernel reads the live rows)
    assert {kv for _, kv in report["graph_keys"]} == {0}


@pytest.mark.kernels
@pytest.mark.parametrize("modes", [[["ar", None], ["dflash", None]], [["ddtree", 3], ["ddtree", 12]]],
                         ids=["ar+dflash", "ddtree"])
def test_kernel_path_is_exact(child, modes):
    """ar, dflash, ddtree at budgets 3 and 12 on kernels == the SDPA path's ar."""
    assert child("tokens", modes)["tokens"] == {f"{mode}/{budget}": True for mode, budget in modes}


@pytest.mark.kernels
def test_drafter_kernel_path_equals_eager(child):
    """GraphedDrafter on kernels (fused projections, split-K non-causal attention) == eager SDPA."""
    report = child("drafter")
    assert report["drafter"]["enabled"]
    assert [n for n, kv in report["drafter"]["keys"]] == [1, 2, 4, 8, 16]
    assert {kv for _, kv in report["drafter"]["keys"]} == {0}
    # q|k|v and gate|up fused into one weight each, the layers' weights now views of them
    d = report["drafter"]
    assert all(d["fused"]) and d["weights_kept"] and d["shared_storage"]
    # sliding-window layers take the kernel path too (causal + window in the attention kernel)
    assert d["sliding"]["enabled"] and d["sliding"]["kinds"] == [[True, 6], [False, None]]
    assert {kv for _, kv in d["sliding"]["keys"]} == {0}


def test_switch(monkeypatch):
    """DDTREE_KERNELS: CPU stays on SDPA unless asked under the interpreter; 0 turns CUDA off."""
    monkeypatch.setattr(runtime, "HAVE_TRITON", True)
    monkeypatch.setattr(runtime, "_capability", lambda device: (9, 0))
    monkeypatch.delenv(runtime.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not runtime.enabled("cpu") and runtime.enabled(torch.device("cuda", 0))
    monkeypatch.setenv(runtime.ENV, "1")
    assert runtime.enabled("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runtime.enabled("cpu")
    monkeypatch.setenv(runtime.ENV, "0")
    assert not runtime.enabled("cuda")
    monkeypatch.delenv(runtime.ENV)
    monkeypatch.setattr(runtime, "_capability", lambda device: (7, 0))  # Volta: SDPA path
    assert not runtime.enabled("cuda")
    monkeypatch.setattr(runtime, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(runtime, "HAVE_TRITON", False)
    assert not runtime.enabled("cuda")
