"""Gated RMSNorm of the GDN output in one kernel (transformers ``Qwen3_5RMSNormGated``; the
pure-torch reference is ``models/hybrid/gdn.py: GatedRMSNorm``), with the same roundings:

    x = o rounded to the model dtype;  n = x * rsqrt(mean(x^2) + eps)  rounded;
    out = (weight * n rounded) * silu(z)   rounded to the model dtype

per value head (normalised over Dv). One program per (row, value head); o fp32 ``[n, Hv, Dv]``,
z a ``[n, Hv * Dv]`` view of the projection (model dtype, unit last stride), weight ``[Dv]``;
the output ``[n, Hv * Dv]`` in the model dtype feeds out_proj.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, stride_z, eps,
                           HV: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BV)
        m = offs < DV
        dt = out_ptr.dtype.element_ty
        x = tl.load(o_ptr + (i * HV + h) * DV + offs, mask=m, other=0.0).to(dt).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / DV + eps)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + i * stride_z + h * DV + offs, mask=m, other=0.0).to(tl.float32)
        y = (w * normed).to(dt).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + (i * HV + h) * DV + offs, y.to(dt), mask=m)


def gated_norm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``norm(o) * weight * silu(z)`` (see the module docstring). Returns ``[n, Hv * Dv]`` in z's
    dtype. Raises ValueError for shapes that do not fit."""
    n, hv, dv = o.shape
    if tuple(z.shape) != (n, hv * dv) or z.stride(-1) != 1 or weight.numel() != dv or not o.is_contiguous():
        raise ValueError(f"gated_norm: o {tuple(o.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty((n, hv * dv), dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(n, hv)](o, z, weight, out, z.stride(0), eps, HV=hv, DV=dv,
                                BV=triton.next_power_of_2(dv), num_warps=1 if dv <= 256 else 4)
    return out
