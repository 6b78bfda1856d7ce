"""GDN "pre" kernel: everything between the fused input projection and the gated delta rule, for
the n new rows of one Gated DeltaNet layer, in one launch (Yang, Kautz & Hatamizadeh, arXiv
2412.06464; transformers ``Qwen3_5GatedDeltaNet``; the pure-torch reference is
``models/hybrid/gdn.py``: ``GatedDeltaNet._conv`` and ``prepare``):

* the depthwise causal conv1d of width K over each row's window, then SiLU (rounded to the model
  dtype, as the torch path does). Row i's window is ``win[i]`` (``models/hybrid/tree.py``): K row
  indices into the layer's conv buffer, whose rows 0..K-2 are the committed conv state and row
  K-1+j block row j. Block rows are read from ``proj`` itself (never from the buffer, which this
  kernel writes), so a tree node's window follows its own ancestors;
* q, k l2-normalised per key head (``x * rsqrt(sum x^2 + 1e-6)``), q times ``Dk^-1/2``; q and k
  stay per KEY head (the rule indexes value head h's key head ``h // (Hv / Hk)``, nothing is
  repeated); v per value head;
* ``beta = sigmoid(b)`` (rounded to the model dtype) and the path cumsum of the decay
  ``G_i = sum_{j anc i} g_j`` with ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus as
  torch's: x above 20);
* ``store_rows``: block row i's inputs go to row i of ``rows`` (default: the conv buffer's row
  K-1+i; what the commit gathers later);
  ``commit`` (one row, a decode step): the buffer's committed rows become the window's last K-1.

Grid ``(n, 2 Hk + Hv)``: program (i, j) does row i's q head j, k head j - Hk or v head j - 2 Hk
(that program also computes beta and G). Outputs fp32: q, k ``[n, Hk, Dk]``, v ``[n, Hv, Dv]``,
beta ``[n, Hv]``, G into a given ``[>= n, Hv]`` tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # one compile for every row count
    def _pre_kernel(proj_ptr, conv_ptr, win_ptr, w_ptr, alog_ptr, dtb_ptr, anc_ptr,
                    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, rows_ptr, n, stride_proj, stride_conv, stride_g,
                    stride_rows, scale,
                    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                    BC: tl.constexpr, STORE_ROW: tl.constexpr, COMMIT: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        is_v = j >= 2 * HK
        offs = tl.arange(0, BC)
        m = offs < tl.where(is_v, DV, DK)
        ch = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK) + offs
        # depthwise causal conv over row i's window (helpers inlined: the interpreter is slow at calls)
        acc = tl.zeros((BC,), dtype=tl.float32)
        for t in tl.static_range(KW):
            r = tl.load(win_ptr + i * KW + t) + tl.zeros((BC,), dtype=tl.int64)
            x = tl.load(proj_ptr + tl.maximum(r - (KW - 1), 0) * stride_proj + ch, mask=m & (r >= KW - 1),
                        other=0.0) + tl.load(conv_ptr + tl.minimum(r, KW - 2) * stride_conv + ch,
                                             mask=m & (r < KW - 1), other=0.0)
            acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + t, mask=m, other=0.0).to(tl.float32)
        if STORE_ROW:  # block row i's inputs, for the commit's conv-state gather
            tl.store(rows_ptr + i * stride_rows + ch, tl.load(proj_ptr + i * stride_proj + ch, mask=m), mask=m)
        if COMMIT:  # one row: the committed rows become the window's last K-1 (all read above)
            tl.debug_barrier()
            for t in tl.static_range(1, KW):
                r = tl.load(win_ptr + i * KW + t) + tl.zeros((BC,), dtype=tl.int64)
                x = tl.load(proj_ptr + tl.maximum(r - (KW - 1), 0) * stride_proj + ch, mask=m & (r >= KW - 1),
                            other=0.0) + tl.load(conv_ptr + tl.minimum(r, KW - 2) * stride_conv + ch,
                                                 mask=m & (r < KW - 1), other=0.0)
                tl.store(conv_ptr + (t - 1) * stride_conv + ch, x, mask=m)
        y = acc / (1.0 + tl.exp(-acc))  # SiLU, rounded to the model dtype as the torch path does
        y = y.to(proj_ptr.dtype.element_ty).to(tl.float32)
        if j < 2 * HK:  # a q or k head: l2 norm (q also scaled)
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) + 1e-6)
            if j < HK:
                tl.store(q_ptr + (i * HK + j) * DK + offs, y * scale, mask=m)
            else:
                tl.store(k_ptr + (i * HK + j - HK) * DK + offs, y, mask=m)
        else:  # a v head h; beta and the path-cumsum decay G of (row i, head h)
            h = j - 2 * HK
            tl.store(v_ptr + (i * HV + h) * DV + offs, y, mask=m)
            col = 2 * HK * DK + 2 * HV * DV + h  # b, then a HV columns later
            b = tl.load(proj_ptr + i * stride_proj + col).to(tl.float32)
            tl.store(beta_ptr + i * HV + h, (1.0 / (1.0 + tl.exp(-b))).to(proj_ptr.dtype.element_ty).to(tl.float32))
            a_log = tl.load(alog_ptr + h).to(tl.float32)
            dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
            gsum = tl.zeros((16,), dtype=tl.float32)
            for j0 in range(0, i + 1, 16):  # ancestors of i have indices <= i
                rows = j0 + tl.arange(0, 16)
                rm = rows <= i
                on = tl.load(anc_ptr + i * n + rows, mask=rm, other=0) != 0
                a = tl.load(proj_ptr + rows * stride_proj + col + HV, mask=rm, other=0.0).to(tl.float32) + dt_bias
                sp = tl.where(a > 20.0, a, tl.where(a < -15.0, tl.exp(a), tl.log(1.0 + tl.exp(a))))  # softplus
                gsum += tl.where(on, -tl.exp(a_log) * sp, 0.0)
            tl.store(g_ptr + i * stride_g + h, tl.sum(gsum, axis=0))


def gdn_pre(proj: Tensor, conv: Tensor, win: Tensor, anc: Tensor, weight: Tensor, a_log: Tensor, dt_bias: Tensor,
            dims: tuple[int, int, int, int], G: Tensor, store_rows: bool = False, commit: bool = False,
            rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run the kernel (see the module docstring) on n = ``proj.shape[0]`` rows.

    proj ``[n, 2 Hk Dk + 2 Hv Dv + 2 Hv]`` (qkv | z | b | a, unit last stride, model dtype);
    conv ``[K-1 (+ >= n), C]`` the layer's conv buffer (contiguous); ``rows`` ``[>= n, C]`` (unit
    last stride; None: the conv buffer's rows from K-1) receive the block's inputs with
    ``store_rows``; win long ``[n, K]``; anc bool
    ``[n, n]`` ancestor-or-self mask; weight ``[C, K]`` (conv1d weight, contiguous); a_log,
    dt_bias ``[Hv]``; dims (Hk, Hv, Dk, Dv); G fp32 ``[>= n, Hv]`` (unit last stride) receives the
    path-cumsum gates. Returns q, k ``[n, Hk, Dk]``, v ``[n, Hv, Dv]``, beta ``[n, Hv]`` (fp32).
    ``commit`` needs n == 1. Raises ValueError for a commit of several rows or layouts that do not fit."""
    hk, hv, dk, dv = dims
    n, kw = proj.shape[0], win.shape[1]
    if commit and n != 1:
        raise ValueError(f"commit=True updates the conv state in place and needs one row, got {n}")
    if rows is None:
        rows = conv[kw - 1:] if conv.shape[0] >= kw else conv
    if proj.stride(-1) != 1 or not conv.is_contiguous() or tuple(anc.shape) != (n, n) or win.shape[0] < n or (
            store_rows and (rows.shape[0] < n or rows.stride(-1) != 1)):
        raise ValueError(f"gdn_pre: proj {tuple(proj.shape)} (unit last stride), contiguous conv buffer, "
                         f"anc {tuple(anc.shape)}, win {tuple(win.shape)} and rows {tuple(rows.shape)} for {n} rows")
    dev, f32 = proj.device, torch.float32
    q = torch.empty((n, hk, dk), dtype=f32, device=dev)
    k = torch.empty((n, hk, dk), dtype=f32, device=dev)
    v = torch.empty((n, hv, dv), dtype=f32, device=dev)
    beta = torch.empty((n, hv), dtype=f32, device=dev)
    _pre_kernel[(n, 2 * hk + hv)](
        proj, conv, win.contiguous(), weight.contiguous(), a_log, dt_bias, anc.contiguous().view(torch.uint8),
        q, k, v, G, beta, rows, n, proj.stride(0), conv.stride(0), G.stride(0), rows.stride(0), dk ** -0.5,
        HK=hk, HV=hv, DK=dk, DV=dv, KW=kw, BC=triton.next_power_of_2(max(dk, dv)),
        STORE_ROW=store_rows, COMMIT=commit, num_warps=1 if max(dk, dv) <= 128 else 4)
    return q, k, v, beta
