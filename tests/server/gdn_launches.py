"""Compile the GDN kernels' real launches for sm_90 (Hopper) on a machine without a GPU.

Each wrapper of kernels/gdn_*.py runs on CPU tensors at the Qwen3.6-27B shape with its kernel
object replaced by a launch recorder (the wrapper's own argument preparation runs for real); each
recorded launch (argument dtypes, constexprs, num_warps) is then compiled by ``triton.compile``
for ``GPUTarget("cuda", 90, 32)`` down to a cubin with the ptxas bundled in Triton's wheel. This
catches what the CPU interpreter accepts but the compiler rejects (type mismatches across
branches, unsupported dot shapes) before a GPU run.
"""

from __future__ import annotations

import torch

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
        torch.int32: "*i32", torch.uint8: "*u8"}


class LaunchRecorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records the call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def _signature(fn, args: tuple, kw: dict) -> tuple[dict, dict, dict]:
    sig, const = {}, {}
    values = dict(zip([p.name for p in fn.params], args))
    values.update({k: v for k, v in kw.items() if k not in ("num_warps", "num_stages")})
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _PTR[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if abs(v) < 2 ** 31 else "i64"
        else:
            sig[p.name] = "fp32"
    opts = {k: kw[k] for k in ("num_warps", "num_stages") if k in kw}
    return sig, const, opts


def record_launches() -> list[tuple]:
    """(kernel, args, kwargs) of every launch the wrappers make at the 27B shape (bf16 and fp32)."""
    from ddtree_server.kernels import gdn_norm, gdn_pre, gdn_state, gdn_tree

    hk, hv, dk, dv, kw, n = 16, 48, 128, 128, 4, 80
    conv_dim, f32 = 2 * hk * dk + hv * dv, torch.float32
    mods = {gdn_pre: "_pre_kernel", gdn_tree: "_prep_kernel", gdn_state: "_step_kernel", gdn_norm: "_gated_norm_kernel"}
    extra = {gdn_tree: "_solve_kernel", gdn_state: "_fold_kernel"}
    saved = {(m, a): getattr(m, a) for m, a in list(mods.items()) + list(extra.items())}
    recorders = {key: LaunchRecorder(fn) for key, fn in saved.items()}
    try:
        for (m, a), rec in recorders.items():
            setattr(m, a, rec)
        anc = torch.ones(n, n, dtype=torch.bool).tril_()
        win = torch.arange(n)[:, None] + torch.arange(kw)[None, :]
        for dtype in (torch.bfloat16, f32):
            proj = torch.zeros(n, conv_dim + hv * dv + 2 * hv, dtype=dtype)
            conv = torch.zeros(kw - 1 + n, conv_dim, dtype=dtype)
            w, a_log, dt_bias = torch.zeros(conv_dim, kw, dtype=dtype), torch.zeros(hv, dtype=dtype), torch.zeros(hv, dtype=dtype)
            G = torch.zeros(n, hv)
            gdn_pre.gdn_pre(proj, conv, win, anc, w, a_log, dt_bias, (hk, hv, dk, dv), G, store_rows=True)
            gdn_pre.gdn_pre(proj[:1], conv, win[:1], anc[:1, :1], w, a_log, dt_bias, (hk, hv, dk, dv), G, commit=True)
            gdn_norm.gated_norm(torch.zeros(n, hv, dv), proj[:, conv_dim:conv_dim + hv * dv], torch.zeros(dv, dtype=dtype), 1e-6)
        q, k = torch.zeros(n, hk, dk), torch.zeros(n, hk, dk)
        v, beta, state = torch.zeros(n, hv, dv), torch.zeros(n, hv), torch.zeros(hv, dk, dv)
        gdn_tree.tree_rule(q, k, v, G, beta, state, anc, torch.zeros(n, hv, dk), torch.zeros(n, hv, dv))
        gdn_state.step_rule(q[:1], k[:1], v[:1], G[:1], beta[:1], state)
        gdn_state.fold_path(torch.zeros(2, hv, dk, dv), torch.zeros(2, n, hv, dk), torch.zeros(2, n, hv, dv),
                            torch.zeros(2, n, hv), torch.arange(5))
    finally:
        for (m, a), fn in saved.items():
            setattr(m, a, fn)
    return [(rec.fn, args, kwargs) for rec in recorders.values() for args, kwargs in rec.calls]


def compile_all() -> list[str]:
    """Compile every recorded launch for sm_90; returns their names. Raises on a compile error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = []
    for fn, args, kwargs in record_launches():
        sig, const, opts = _signature(fn, args, kwargs)
        triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32), options=opts)
        names.append(f"{fn.__name__}{sorted((k, v) for k, v in const.items() if not isinstance(v, str))}")
    return names
