"""kernels/gemv.py: the Triton skinny GEMM against its torch reference, under TRITON_INTERPRET=1 on
CPU (fp32 and fp16; the interpreter mishandles bf16). Skipped where Triton is not installed.

The interpreter must be chosen before triton is first imported, so the kernel runs in a child
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
from ddtree_server.kernels import gemv
out = {}
for dtype in (torch.float32, torch.float16):
    for m in (1, 5, 20):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, 300, generator=g).to(dtype)   # K not a multiple of any block: masked tail
        w = torch.randn(70, 300, generator=g).to(dtype)  # N not a multiple of block_n
        ref = gemv.skinny_matmul_ref(x, w).float()
        for cfg in (gemv.CONFIGS_M1 if m == 1 else gemv.CONFIGS_MN)[:4]:
            y = gemv.skinny_matmul(x, w, cfg)
            key = f"{str(dtype)[6:]}/{m}/{cfg.name}"
            out[key] = [list(y.shape), str(y.dtype)[6:], ((y.float() - ref).abs() / (1 + ref.abs())).max().item()]
errors = {}
for name, args in {"shape": (torch.randn(2, 8), torch.randn(4, 9)),
                   "dtype": (torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float16)),
                   "block_m": (torch.randn(2, 8), torch.randn(4, 8), gemv.GemvConfig(block_m=8))}.items():
    try:
        gemv.skinny_matmul(*args)
    except ValueError as exc:
        errors[name] = str(exc)
print(json.dumps({"results": out, "errors": errors}))
"""


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_matches_reference(report):
    res = report["results"]
    assert len(res) == 2 * 3 * 4
    for key, (shape, dtype, err) in res.items():
        m = int(key.split("/")[1])
        assert shape == [m, 70] and dtype == key.split("/")[0], key
        assert err < (1e-5 if dtype == "float32" else 2e-3), (key, err)


def test_bad_inputs(report):
    e = report["errors"]
    assert "need x" in e["shape"] and "dtype" in e["dtype"] and "block_m" in e["block_m"]
