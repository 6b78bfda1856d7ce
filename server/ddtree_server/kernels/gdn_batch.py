"""GDN decode step of several requests in two launches, each request on its slot's pooled state (the
batch engine's plain rows; per-request kernels: ``gdn_pre.py`` with ``commit`` and ``gdn_state.py:
step_rule``, whose math and roundings these repeat; pure-torch reference
``models/hybrid/gdn_batch.py: step_torch``):

* ``step_pre``: grid ``(b, 2 Hk + Hv)``: request i's causal conv over its slot's K-1 committed conv
  rows and its new row, SiLU (rounded to the model dtype), the conv state shifted in place; q, k
  l2-normalised per key head (q times ``Dk^-1/2``), v; ``beta = sigmoid(b)`` and
  ``g = -exp(A_log) * softplus(a + dt_bias)`` per value head;
* ``step_states``: grid ``(b, Hv, V tiles)``: ``S <- exp(g) S;  u = beta (v - S^T k);
  S <- S + k u^T;  o = S^T q`` on request i's slot of the layer's state, in place.

Programs never mix requests, so a request's rows are bitwise those of the same request alone
(in any batch, at any position). The pooled tensors are a layer's views ``conv [slots, K-1+cap, C]``
and ``state [slots, Hv, Dk, Dv]`` (slot stride free, the rest contiguous).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pre_kernel(proj_ptr, conv_ptr, slot_ptr, w_ptr, alog_ptr, dtb_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr,
                    stride_proj, stride_slot, stride_conv, scale,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                    BC: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        is_v = j >= 2 * HK
        offs = tl.arange(0, BC)
        m = offs < tl.where(is_v, DV, DK)
        ch = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK) + offs
        conv = conv_ptr + tl.load(slot_ptr + i).to(tl.int64) * stride_slot
        row = proj_ptr + i * stride_proj
        acc = tl.zeros((BC,), dtype=tl.float32)
        for t in tl.static_range(KW - 1):
            x = tl.load(conv + t * stride_conv + ch, mask=m, other=0.0)
            acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + t, mask=m, other=0.0).to(tl.float32)
        new = tl.load(row + ch, mask=m, other=0.0)
        acc += new.to(tl.float32) * tl.load(w_ptr + ch * KW + KW - 1, mask=m, other=0.0).to(tl.float32)
        tl.debug_barrier()
        for t in tl.static_range(1, KW - 1):   # the conv state: the window's last K-1 rows
            tl.store(conv + (t - 1) * stride_conv + ch, tl.load(conv + t * stride_conv + ch, mask=m), mask=m)
        tl.store(conv + (KW - 2) * stride_conv + ch, new, mask=m)
        y = acc / (1.0 + tl.exp(-acc))
        y = y.to(proj_ptr.dtype.element_ty).to(tl.float32)
        if j < 2 * HK:
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) + 1e-6)
            if j < HK:
                tl.store(q_ptr + (i * HK + j) * DK + offs, y * scale, mask=m)
            else:
                tl.store(k_ptr + (i * HK + j - HK) * DK + offs, y, mask=m)
        else:
            h = j - 2 * HK
            tl.store(v_ptr + (i * HV + h) * DV + offs, y, mask=m)
            col = 2 * HK * DK + 2 * HV * DV + h
            b = tl.load(row + col).to(tl.float32)
            tl.store(beta_ptr + i * HV + h, (1.0 / (1.0 + tl.exp(-b))).to(proj_ptr.dtype.element_ty).to(tl.float32))
            a = tl.load(row + col + HV).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
            sp = tl.where(a > 20.0, a, tl.where(a < -15.0, tl.exp(a), tl.log(1.0 + tl.exp(a))))
            tl.store(g_ptr + i * HV + h, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp)

    @triton.jit
    def _state_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, slot_ptr, o_ptr, stride_slot,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        kh = h // (HV // HK)
        dk = tl.arange(0, BK)
        km = dk < DK
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        vm = dv < DV
        q = tl.load(q_ptr + (i * HK + kh) * DK + dk, mask=km, other=0.0)
        k = tl.load(k_ptr + (i * HK + kh) * DK + dk, mask=km, other=0.0)
        v = tl.load(v_ptr + (i * HV + h) * DV + dv, mask=vm, other=0.0)
        g = tl.load(g_ptr + i * HV + h)
        beta = tl.load(beta_ptr + i * HV + h)
        state = s_ptr + tl.load(slot_ptr + i).to(tl.int64) * stride_slot
        ptrs = state + h * DK * DV + dk[:, None] * DV + dv[None, :]
        msk = km[:, None] & vm[None, :]
        s = tl.load(ptrs, mask=msk, other=0.0) * tl.exp(g)
        u = (v - tl.sum(k[:, None] * s, axis=0)) * beta
        s = s + k[:, None] * u[None, :]
        tl.store(ptrs, s, mask=msk)
        tl.store(o_ptr + (i * HV + h) * DV + dv, tl.sum(q[:, None] * s, axis=0), mask=vm)


def step_pre(proj: Tensor, conv: Tensor, slots: Tensor, weight: Tensor, a_log: Tensor, dt_bias: Tensor,
             dims: tuple[int, int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """proj ``[b, P]`` (request i's row; unit last stride), conv ``[slots, K-1+cap, C]`` (a layer's
    view; rows contiguous), slots long ``[b]``, weight ``[C, K]``; dims (Hk, Hv, Dk, Dv). Returns q,
    k ``[b, Hk, Dk]``, v ``[b, Hv, Dv]``, g, beta ``[b, Hv]`` (fp32); the slots' conv states shift in
    place. Raises ValueError for layouts that do not fit."""
    hk, hv, dk, dv = dims
    b, kw = proj.shape[0], weight.shape[1]
    if proj.stride(-1) != 1 or conv.stride(-1) != 1 or conv.stride(1) != conv.shape[2] or slots.numel() != b:
        raise ValueError(f"step_pre: proj {tuple(proj.shape)}, conv {tuple(conv.shape)}, {slots.numel()} slots")
    dev, f32 = proj.device, torch.float32
    q = torch.empty((b, hk, dk), dtype=f32, device=dev)
    k = torch.empty((b, hk, dk), dtype=f32, device=dev)
    v = torch.empty((b, hv, dv), dtype=f32, device=dev)
    g = torch.empty((b, hv), dtype=f32, device=dev)
    beta = torch.empty((b, hv), dtype=f32, device=dev)
    _pre_kernel[(b, 2 * hk + hv)](
        proj, conv, slots, weight.contiguous(), a_log, dt_bias, q, k, v, g, beta,
        proj.stride(0), conv.stride(0), conv.stride(1), dk ** -0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, KW=kw, BC=triton.next_power_of_2(max(dk, dv)),
        num_warps=1 if max(dk, dv) <= 128 else 4)
    return q, k, v, g, beta


def step_states(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor,
                block_v: int = 32) -> Tensor:
    """One token per request on ``state`` ``[slots, Hv, Dk, Dv]`` fp32 (a layer's view, each slot
    contiguous) at ``slots``, in place; inputs as ``step_pre`` returns them. Returns o ``[b, Hv, Dv]``."""
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk or tuple(state.shape[1:]) != (hv, dk, dv) or not state[0].is_contiguous():
        raise ValueError(f"step_states: q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}")
    bk, bv = triton.next_power_of_2(dk), min(block_v, triton.next_power_of_2(dv))
    o = torch.empty((b, hv, dv), dtype=torch.float32, device=q.device)
    _state_kernel[(b, hv, triton.cdiv(dv, bv))](q, k, v, g, beta, state, slots, o, state.stride(0),
                                                HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv, num_warps=4)
    return o
