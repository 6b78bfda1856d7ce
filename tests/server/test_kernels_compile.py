"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU: Triton's front end, LLVM and the
ptxas bundled in the Triton wheel run on the CPU. The interpreter tests check the arithmetic; this
catches what only the compiler rejects (types, shapes of tl.dot, constexpr branches). A few
configurations the engine launches (bf16 decode / verify / drafter, fp32 for the exactness check)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ddtree_server.kernels import attention_kernels, fused  # noqa: E402

pytestmark = pytest.mark.kernels


def _compile(fn, types: dict, consts: dict, **options):
    sig = {name: types.get(name, "i32") for name in fn.arg_names}
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=options)


@pytest.mark.parametrize("dtype,mode,splits,block_m,d,fused", [("bf16", 1, 33, 64, 128, False),
                                                               ("bf16", 2, 1, 16, 64, False),
                                                               ("fp32", 0, 8, 16, 128, False),
                                                               ("bf16", 1, 17, 16, 64, True)])
def test_attention_compiles(dtype, mode, splits, block_m, d, fused):
    part = "*fp32" if splits > 1 else f"*{dtype}"
    types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "start_ptr": "*i64",
             "mask_ptr": "*u8" if mode == 1 else "*i64", "o_ptr": f"*{dtype}", "po_ptr": part, "pl_ptr": part,
             "cnt_ptr": "*i32", "scale_log2": "fp32"}
    consts = {"MODE": mode, "SPLITS": splits, "BLOCK_M": block_m, "BLOCK_N": 64, "D": d,
              "PREC": "ieee" if dtype == "fp32" else "tf32", "FUSED": fused, "WINDOWED": mode == 2}
    kernel = _compile(attention_kernels.split_kernel, types, consts, num_warps=4, num_stages=2)
    assert 0 < kernel.metadata.shared < 200 * 1024  # fits an SM's shared memory with room to spare
    if splits > 1 and not fused:
        _compile(attention_kernels.merge_kernel, {"po_ptr": "*fp32", "pl_ptr": "*fp32", "o_ptr": f"*{dtype}",
                                           "start_ptr": "*i64"}, {"SPLITS": splits, "SP2": 64, "BLOCK_N": 64, "D": d})


def test_fused_compile():
    types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "qo_ptr",
                                  "kc_ptr", "vc_ptr")}
    types.update(row0_ptr="*i64", eps="fp32")
    _compile(fused._prep_kernel, types, {"NORM": True, "SIGNED": True, "D": 128, "HB": 8}, num_warps=2)
    _compile(fused._silu_mul_kernel, {"g_ptr": "*bf16", "u_ptr": "*bf16", "o_ptr": "*bf16"}, {"BLOCK": 1024})
    _compile(fused._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "o_ptr": "*bf16", "eps": "fp32"},
             {"BLOCK": 4096}, num_warps=8)
