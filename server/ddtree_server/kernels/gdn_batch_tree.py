"""Pending GDN blocks (DFlash chains, DDTree trees) of several requests in three launches, each
request on its slot of the pooled cache (the batch engine; per-request kernels ``gdn_pre.py`` with
``store_rows`` and ``gdn_tree.py: tree_rule``, whose math and order these repeat, so a request's
rows are bitwise those it gets alone; pure-torch reference ``models/hybrid/gdn_batch.py:
chunk_torch``).

The group's rows are ``proj [m, P]`` block after block; request j's block is rows
``[qo[j], qo[j+1])`` on slot ``slots[j]``, its ancestor mask ``anc[j]`` (padded ``[b, R, R]``).
Per row t: ``slot_row``, ``local_row`` (row in its block), ``req_row`` (its request) and its conv
window ``win[t]`` (rows of the slot's conv buffer, ``models/hybrid/tree.py``). The verify scratch
``kk / uu / GG`` is the round's (one for all requests): block j's rows from ``base[j]`` (its row
offset in the round).

* ``pre_rows``: grid ``(m, 2 Hk + Hv)``: conv + SiLU over the window (committed rows from the
  slot's conv state, block rows from ``proj``), the row's inputs to the scratch's ``inputs``, q /
  k l2 norms, v, beta, and the path-cumsum gate G into the block's ``GG`` scratch rows;
* ``tree_rules``: the prep kernel per (value head, row block, request) and the solve kernel per
  (value head, V tile, request) of ``gdn_tree.py`` on each request's rows: k per value head and the
  solved u go to its block's ``kk`` / ``uu`` scratch rows, the state is read from its slot.
Layer views: conv ``[slots, K-1, C]``, state ``[slots, Hv, Dk, Dv]`` (slot stride free, the
rest contiguous), kk ``[rows, Hv, Dk]``, uu ``[rows, Hv, Dv]``, GG ``[rows, Hv]`` (contiguous rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ddtree_server.kernels.gdn_tree import unit_lower_inverse

    @triton.jit
    def _pre_rows_kernel(proj_ptr, conv_ptr, slot_ptr, local_ptr, req_ptr, qo_ptr, win_ptr, w_ptr, alog_ptr,
                         dtb_ptr, anc_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, base_ptr, in_ptr, R,
                         stride_proj, stride_slot, stride_conv, stride_in, scale,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                         BC: tl.constexpr):
        t = tl.program_id(0)
        j = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        i = tl.load(local_ptr + t)
        rq = tl.load(req_ptr + t)
        blk = proj_ptr + tl.load(qo_ptr + rq).to(tl.int64) * stride_proj   # the block's row 0
        conv = conv_ptr + slot * stride_slot
        is_v = j >= 2 * HK
        offs = tl.arange(0, BC)
        m = offs < tl.where(is_v, DV, DK)
        ch = tl.where(is_v, 2 * HK * DK + (j - 2 * HK) * DV, j * DK) + offs
        acc = tl.zeros((BC,), dtype=tl.float32)
        for tt in tl.static_range(KW):
            r = tl.load(win_ptr + t * KW + tt) + tl.zeros((BC,), dtype=tl.int64)
            x = tl.load(blk + tl.maximum(r - (KW - 1), 0) * stride_proj + ch, mask=m & (r >= KW - 1),
                        other=0.0) + tl.load(conv + tl.minimum(r, KW - 2) * stride_conv + ch,
                                             mask=m & (r < KW - 1), other=0.0)
            acc += x.to(tl.float32) * tl.load(w_ptr + ch * KW + tt, mask=m, other=0.0).to(tl.float32)
        row = tl.load(base_ptr + rq).to(tl.int64) + i   # the row's row in the round's scratch
        tl.store(in_ptr + row * stride_in + ch, tl.load(blk + i * stride_proj + ch, mask=m), mask=m)
        y = acc / (1.0 + tl.exp(-acc))
        y = y.to(proj_ptr.dtype.element_ty).to(tl.float32)
        if j < 2 * HK:
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) + 1e-6)
            if j < HK:
                tl.store(q_ptr + (t * HK + j) * DK + offs, y * scale, mask=m)
            else:
                tl.store(k_ptr + (t * HK + j - HK) * DK + offs, y, mask=m)
        else:
            h = j - 2 * HK
            tl.store(v_ptr + (t * HV + h) * DV + offs, y, mask=m)
            col = 2 * HK * DK + 2 * HV * DV + h
            b = tl.load(blk + i * stride_proj + col).to(tl.float32)
            tl.store(beta_ptr + t * HV + h, (1.0 / (1.0 + tl.exp(-b))).to(proj_ptr.dtype.element_ty).to(tl.float32))
            a_log = tl.load(alog_ptr + h).to(tl.float32)
            dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
            gsum = tl.zeros((16,), dtype=tl.float32)
            for j0 in range(0, i + 1, 16):
                rows = j0 + tl.arange(0, 16)
                rm = rows <= i
                on = tl.load(anc_ptr + (rq * R + i) * R + rows, mask=rm, other=0) != 0
                a = tl.load(blk + rows * stride_proj + col + HV, mask=rm, other=0.0).to(tl.float32) + dt_bias
                sp = tl.where(a > 20.0, a, tl.where(a < -15.0, tl.exp(a), tl.log(1.0 + tl.exp(a))))
                gsum += tl.where(on, -tl.exp(a_log) * sp, 0.0)
            tl.store(g_ptr + row * HV + h, tl.sum(gsum, axis=0))

    @triton.jit(do_not_specialize=["R", "NP"])
    def _prep_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, anc_ptr, kk_ptr, a_ptr, p_ptr, d_ptr, base_ptr, qo_ptr,
                     R, NP,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        j = tl.program_id(2)
        base = tl.load(qo_ptr + j)
        n = tl.load(qo_ptr + j + 1) - base
        if b * 16 < n:
            row0 = tl.load(base_ptr + j).to(tl.int64)   # the block's first row in the round's scratch
            q_ptr += base * HK * DK
            k_ptr += base * HK * DK
            beta_ptr += base * HV
            g_ptr += row0 * HV
            kk_ptr += row0 * HV * DK
            anc_ptr += j * R * R
            off = j.to(tl.int64) * HV * NP
            a_ptr += off * NP
            p_ptr += off * NP
            d_ptr += off * 16
            kh = h // (HV // HK)
            ar = tl.arange(0, 16)
            dk = tl.arange(0, BK)
            km = dk < DK
            r = b * 16 + ar
            rm = r < n
            kb = tl.load(k_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            qb = tl.load(q_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            gb = tl.load(g_ptr + r * HV + h, mask=rm, other=0.0)
            beta = tl.load(beta_ptr + r * HV + h, mask=rm, other=0.0)
            tl.store(kk_ptr + r[:, None] * (HV * DK) + h * DK + dk[None, :], kb, mask=rm[:, None] & km[None, :])
            for c in range(0, b + 1):
                cc = c * 16 + ar
                cm = cc < n
                kc = tl.load(k_ptr + (cc[:, None] * HK + kh) * DK + dk[None, :], mask=cm[:, None] & km[None, :],
                             other=0.0)
                gc = tl.load(g_ptr + cc * HV + h, mask=cm, other=0.0)
                on = tl.load(anc_ptr + r[:, None] * R + cc[None, :], mask=rm[:, None] & cm[None, :], other=0) != 0
                decay = tl.exp(tl.where(on, gb[:, None] - gc[None, :], float("-inf")))
                kk = tl.dot(kb, tl.trans(kc), input_precision=PREC)
                qk = tl.dot(qb, tl.trans(kc), input_precision=PREC)
                a = tl.where(on & (r[:, None] != cc[None, :]), kk * decay * beta[:, None], 0.0)
                blk = (h * NP + r[:, None]) * NP + cc[None, :]
                tl.store(a_ptr + blk, a)
                tl.store(p_ptr + blk, qk * decay)
                if c == b:
                    tl.store(d_ptr + (h * NP + r[:, None]) * 16 + ar[None, :], unit_lower_inverse(a, ar, ar))

    @triton.jit(do_not_specialize=["NP"])
    def _solve_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, a_ptr, p_ptr, d_ptr, u_ptr, o_ptr, slots_ptr,
                      qo_ptr, base_ptr, NP, stride_sslot,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        h = tl.program_id(0)
        j = tl.program_id(2)
        base = tl.load(qo_ptr + j)
        n = tl.load(qo_ptr + j + 1) - base
        slot = tl.load(slots_ptr + j).to(tl.int64)
        row0 = tl.load(base_ptr + j).to(tl.int64)   # the block's first row in the round's scratch
        q_ptr += base * HK * DK
        k_ptr += base * HK * DK
        v_ptr += base * HV * DV
        o_ptr += base * HV * DV
        beta_ptr += base * HV
        g_ptr += row0 * HV
        s_ptr += slot * stride_sslot
        u_ptr += row0 * HV * DV
        off = j.to(tl.int64) * HV * NP
        a_ptr += off * NP
        p_ptr += off * NP
        d_ptr += off * 16
        kh = h // (HV // HK)
        ar = tl.arange(0, 16)
        dk = tl.arange(0, BK)
        km = dk < DK
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        vm = dv < DV
        s0 = tl.load(s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
        for b in range(0, tl.cdiv(n, 16)):
            r = b * 16 + ar
            rm = r < n
            kb = tl.load(k_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :],
                         other=0.0)
            qb = tl.load(q_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :],
                         other=0.0)
            vb = tl.load(v_ptr + (r[:, None] * HV + h) * DV + dv[None, :], mask=rm[:, None] & vm[None, :], other=0.0)
            eg = tl.exp(tl.load(g_ptr + r * HV + h, mask=rm, other=0.0))
            beta = tl.load(beta_ptr + r * HV + h, mask=rm, other=0.0)
            rhs = beta[:, None] * (vb - eg[:, None] * tl.dot(kb, s0, input_precision=PREC))
            out = eg[:, None] * tl.dot(qb, s0, input_precision=PREC)
            for c in range(0, b):
                cc = c * 16 + ar
                uc = tl.load(u_ptr + cc[:, None] * (HV * DV) + h * DV + dv[None, :],
                             mask=(cc < n)[:, None] & vm[None, :], other=0.0)
                blk = (h * NP + r[:, None]) * NP + cc[None, :]
                rhs -= tl.dot(tl.load(a_ptr + blk), uc, input_precision=PREC)
                out += tl.dot(tl.load(p_ptr + blk), uc, input_precision=PREC)
            ub = tl.dot(tl.load(d_ptr + (h * NP + r[:, None]) * 16 + ar[None, :]), rhs, input_precision=PREC)
            pbb = tl.load(p_ptr + (h * NP + r[:, None]) * NP + (b * 16 + ar)[None, :])
            out += tl.dot(pbb, ub, input_precision=PREC)
            tl.store(u_ptr + r[:, None] * (HV * DV) + h * DV + dv[None, :], ub, mask=rm[:, None] & vm[None, :])
            tl.store(o_ptr + (r[:, None] * HV + h) * DV + dv[None, :], out, mask=rm[:, None] & vm[None, :])
            tl.debug_barrier()


def pre_rows(proj: Tensor, conv: Tensor, GG: Tensor, inputs: Tensor, ch, weight: Tensor, a_log: Tensor,
             dt_bias: Tensor, dims: tuple[int, int, int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """See the module docstring; ``ch``: the group's geometry (``gdn_batch.Chunks``). Returns q, k
    ``[m, Hk, Dk]``, v ``[m, Hv, Dv]``, beta ``[m, Hv]`` (fp32); G and the rows' conv inputs go to
    the blocks' rows of ``GG`` and ``inputs`` (``[rows, C]``)."""
    hk, hv, dk, dv = dims
    m, kw = proj.shape[0], ch.win.shape[1]
    if proj.stride(-1) != 1 or conv.stride(-1) != 1 or conv.stride(1) != conv.shape[2] or not GG.is_contiguous() \
            or inputs.stride(-1) != 1:
        raise ValueError(f"pre_rows: proj {tuple(proj.shape)}, conv {tuple(conv.shape)}, GG {tuple(GG.shape)}")
    dev, f32 = proj.device, torch.float32
    q = torch.empty((m, hk, dk), dtype=f32, device=dev)
    k = torch.empty((m, hk, dk), dtype=f32, device=dev)
    v = torch.empty((m, hv, dv), dtype=f32, device=dev)
    beta = torch.empty((m, hv), dtype=f32, device=dev)
    _pre_rows_kernel[(m, 2 * hk + hv)](
        proj, conv, ch.slot_of_row, ch.local, ch.req, ch.qo, ch.win.contiguous(), weight.contiguous(), a_log, dt_bias,
        ch.anc.view(torch.uint8), q, k, v, GG, beta, ch.base, inputs, ch.r, proj.stride(0), conv.stride(0),
        conv.stride(1), inputs.stride(0), dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, KW=kw, BC=triton.next_power_of_2(max(dk, dv)),
        num_warps=1 if max(dk, dv) <= 128 else 4)
    return q, k, v, beta


def tree_rules(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, state: Tensor, kk: Tensor, uu: Tensor, GG: Tensor,
               ch, precision: str = "ieee", block_v: int = 16) -> Tensor:
    """All rows of the group's blocks from their slots' states (read only); k per value head and u
    to the blocks' rows of the round's ``kk`` / ``uu``. Returns o ``[m, Hv, Dv]`` fp32 (see the module docstring)."""
    m, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk or tuple(state.shape[1:]) != (hv, dk, dv) or not (kk.is_contiguous() and uu.is_contiguous()
                                                                  and GG.is_contiguous()):
        raise ValueError(f"tree_rules: q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}")
    b = ch.anc.shape[0]
    nb = triton.cdiv(ch.r, 16)
    np_ = nb * 16
    dev = q.device
    a = torch.empty((b, hv, np_, np_), dtype=torch.float32, device=dev)
    p = torch.empty_like(a)
    d = torch.empty((b, hv, np_, 16), dtype=torch.float32, device=dev)
    o = torch.empty((m, hv, dv), dtype=torch.float32, device=dev)
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, min(block_v, triton.next_power_of_2(dv)))
    _prep_kernel[(hv, nb, b)](q, k, GG, beta, ch.anc.view(torch.uint8), kk, a, p, d, ch.base, ch.qo, ch.r, np_,
                              HK=hk, HV=hv, DK=dk, BK=bk, PREC=precision, num_warps=4)
    _solve_kernel[(hv, triton.cdiv(dv, bv), b)](q, k, v, GG, beta, state, a, p, d, uu, o, ch.slots, ch.qo, ch.base,
                                                np_, state.stride(0), HK=hk, HV=hv, DK=dk,
                                                DV=dv, BK=bk, BV=bv, PREC=precision, num_warps=8)
    return o
