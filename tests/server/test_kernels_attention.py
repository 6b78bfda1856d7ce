"""kernels/attention.py and kernels/fused.py against their torch references, under TRITON_INTERPRET=1
on CPU (fp32 and fp16; the interpreter mishandles bf16). Skipped where Triton is not installed.

The interpreter must be chosen before triton is first imported, so the kernels run in a child
process with TRITON_INTERPRET=1 that reports max errors as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]   # the children import tests.server.interp_fast
pytestmark = pytest.mark.kernels

_CHILD = r"""
import json, torch
from tests.server.interp_fast import install
install()
from ddtree_server.kernels import attention as A, fused as F
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)

def tree_mask(n):
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n):
        anc[i] = anc[int(torch.randint(0, i, (1,), generator=g))]
        anc[i, i] = True
    return anc

def err(a, b):
    return ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()

att = {}
cases = [(dt, hq, hkv, d, n, s, mode) for dt in ("float32",) for hq, hkv, d in ((4, 2, 16), (9, 3, 64))
         for n in (1, 6, 17) for s in (0, 70) for mode in ("causal", "tree", "full")]
cases += [("float16", 8, 2, 128, 5, 90, "tree"), ("float16", 9, 3, 64, 1, 200, "causal"),
          ("float32", 8, 8, 32, 3, 40, "full")]
cases = [c + (0,) for c in cases] + [("float32", 8, 2, 32, n, s, mode, w) for n, s, mode, w in
                                     ((1, 200, "causal", 5), (9, 70, "causal", 70), (9, 70, "full", 7), (16, 0, "full", 3))]
for dt, hq, hkv, d, n, s, mode, window in cases:
    dtype = getattr(torch, dt)
    rows = 256
    k, v = (torch.randn(hkv, rows, d, generator=g).to(dtype) for _ in range(2))
    k[:, s + n:] = float("nan")  # rows past the live length must never be read
    v[:, s + n:] = float("nan")
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    blk = tree_mask(n) if mode == "tree" else None
    ref = A.attention_ref(q, k, v, s, mode, blk, window=window)
    splits = A.plan(n, hq // hkv, hkv, d, rows, "cpu")[2]
    got = A.decode_attention(q, k, v, torch.tensor(s), mode, blk, window=window)
    att[f"{dt}/{hq}x{hkv}x{d}/n{n}/s{s}/{mode}/w{window}/splits{splits}"] = [dt, list(got.shape), str(got.dtype)[6:],
                                                                           err(got, ref)]
# forced split counts: one split (no merge) and many mostly empty splits; a strided q; an out buffer
q = torch.randn(7, 12, 64, generator=g)[:, 2:10]
k, v = torch.randn(2, 300, 64, generator=g), torch.randn(2, 300, 64, generator=g)
blk = tree_mask(7)
ref = A.attention_ref(q, k, v, 33, "tree", blk)
out = torch.empty(7, 8, 64)
forced = {"one": A.AttnConfig(max_splits=1), "many": A.AttnConfig(ctas_per_sm=64, block_n=16),
          "fused": A.AttnConfig(ctas_per_sm=64, block_n=16, fused_merge=True)}
for name, cfg in forced.items():
    got = A.decode_attention(q, k, v, torch.tensor(33), "tree", blk, out=out, config=cfg)
    att[f"forced/{name}/splits{A.plan(7, 4, 2, 64, 300, 'cpu', cfg)[2]}"] = ["float32", list(got.shape), "float32", err(got, ref)]

errors = {}
bad = {"shape": lambda: A.decode_attention(torch.randn(2, 3, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.tensor(0)),
       "mode": lambda: A.decode_attention(torch.randn(2, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.tensor(0), "sliding"),
       "mask": lambda: A.decode_attention(torch.randn(2, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.tensor(0), "tree"),
       "head_dim": lambda: A.decode_attention(torch.randn(2, 4, 24), torch.randn(2, 9, 24), torch.randn(2, 9, 24), torch.tensor(0)),
       "start": lambda: A.decode_attention(torch.randn(2, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.tensor([0])),
       "window": lambda: A.decode_attention(torch.randn(2, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.tensor(0),
                                            "tree", torch.ones(2, 2, dtype=torch.bool), window=4)}
for name, call in bad.items():
    try:
        call()
    except ValueError as exc:
        errors[name] = str(exc)

fused = {}
for dt in ("float32", "float16"):
    dtype = getattr(torch, dt)
    for norm in (True, False):
        for signed in (True, False):
            hq, hkv, d, n, r0 = 9, 3, 64, 5, 11
            qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).to(dtype)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            w = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if norm else None for _ in range(2)]
            ang = (torch.arange(n)[:, None] + 7) * torch.rand(d // 2, generator=g)
            cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
            if signed:
                sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2:]), -1)
            caches = [torch.zeros(hkv, 40, d, dtype=dtype) for _ in range(6)]
            want = F.qkv_prep_ref(q, k, v, *w, 1e-6, cos, sin, caches[0], caches[1], r0, signed)
            got = F.qkv_prep(q, k, v, *w, 1e-6, cos[:, None], sin[:, None], caches[2], caches[3], torch.tensor(r0), signed)
            kv_only = F.qkv_prep(None, k, v, *w, 1e-6, cos, sin, caches[4], caches[5], torch.tensor(r0), signed)
            fused[f"prep/{dt}/norm{norm}/signed{signed}"] = [dt, err(got, want), err(caches[2], caches[0]),
                                                            err(caches[3], caches[1]), err(caches[4], caches[0]),
                                                            kv_only is None]
            # a batch's rows: token i to (page / slot x[i], row r[i]) of a pool layer [X, hkv, R, d]
            pools = [torch.zeros(4, hkv, 8, d, dtype=dtype) for _ in range(2)]
            x_r = torch.randperm(32, generator=g)[:n]
            x, r = x_r // 8, x_r % 8
            off = x * pools[0].stride(0) + r * pools[0].stride(2)
            got = F.qkv_prep_rows(q, k, v, *w, 1e-6, cos, sin, pools[0], pools[1], off, signed)
            kw_, vw_ = torch.zeros(hkv, n, d, dtype=dtype), torch.zeros(hkv, n, d, dtype=dtype)
            want = F.qkv_prep_ref(q, k, v, *w, 1e-6, cos, sin, kw_, vw_, 0, signed)
            hit = torch.zeros(4, 8, dtype=torch.bool)
            hit[x, r] = True
            fused[f"rows/{dt}/norm{norm}/signed{signed}"] = [
                dt, err(got, want), err(pools[0][x, :, r], kw_.transpose(0, 1)), err(pools[1][x, :, r], vw_.transpose(0, 1)),
                bool((pools[0].permute(0, 2, 1, 3)[~hit] == 0).all() and (pools[1].permute(0, 2, 1, 3)[~hit] == 0).all())]
    gate_up = torch.randn(3, 2 * 1500, generator=g).to(dtype)
    gate, up = gate_up.split(1500, -1)
    fused[f"silu/{dt}"] = [dt, err(F.silu_mul(gate, up), F.silu_mul_ref(gate, up))]
    for width in (64, 576, 4096):  # one warp, 4 and 8 warps; a width that is not a power of two
        x = torch.randn(3, 2, width, generator=g).to(dtype) * 3
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype)
        got = F.rms_norm(x, w, 1e-5)
        fused[f"rms/{dt}/{width}"] = [dt, err(got, F.rms_norm_ref(x, w, 1e-5)), list(got.shape) == list(x.shape)]
counters = int(A._COUNTERS[torch.device("cpu")].abs().sum())  # the fused merge leaves them at 0

print(json.dumps({"attention": att, "errors": errors, "fused": fused, "counters": counters}))
"""


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _tol(dtype: str) -> float:
    return 2e-5 if dtype == "float32" else 3e-3


def test_attention_matches_reference(report):
    res = report["attention"]
    assert len(res) == 36 + 3 + 4 + 3
    splits = {int(key.rsplit("splits", 1)[1]) for key in res}
    assert 1 in splits and max(splits) > 8  # both the direct store and the merge kernel ran
    for key, (dtype, shape, out_dtype, err) in res.items():
        assert out_dtype == dtype and len(shape) == 3, key
        assert err < _tol(dtype), (key, err)  # NaN rows past the live length would give NaN here
    assert report["counters"] == 0


def test_split_count_does_not_depend_on_the_number_of_query_tokens():
    from ddtree_server.kernels.attention import plan

    for rep, hkv, d in ((4, 8, 128), (3, 3, 64), (6, 4, 256)):
        shapes = {plan(n, rep, hkv, d, 4096, "cpu") for n in (1, 16, 17, 65, 80)}
        assert len(shapes) == 1, (rep, hkv, d, shapes)  # block_m, splits and block_n alike
    # the bitwise check itself needs the GPU's MMA units: tests/server/test_kernels_gpu.py


def test_attention_bad_inputs(report):
    e = report["errors"]
    assert set(e) == {"shape", "mode", "mask", "head_dim", "start", "window"}
    assert "hkv | hq" in e["shape"] and "sliding" in e["mode"] and "block mask" in e["mask"]
    assert "head_dim 24" in e["head_dim"] and "0-d" in e["start"] and "tree mask" in e["window"]


def test_fused_match_reference(report):
    res = report["fused"]
    assert len(res) == 2 * 8 + 2 + 2 * 3
    for key, (dtype, *errs) in res.items():
        if key.startswith(("prep/", "rows/", "rms/")):
            assert errs[-1] is True, key  # prep: no queries asked, none returned; rows: no other row written; rms: shape kept
            errs = errs[:-1]
        assert max(errs) < _tol(dtype), (key, errs)
