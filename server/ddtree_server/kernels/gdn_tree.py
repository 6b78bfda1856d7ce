"""Tree-masked chunked gated delta rule for one block of n nodes (a draft tree or a chain), in two
launches; the pure-torch reference is ``models/hybrid/delta.py: tree_chunk`` (the math is in its
docstring and docs/hybrid.md section 2). Per value head h, with M the ancestor-or-self mask and
G the path-cumsum gates (``G = M g``, from ``gdn_pre``):

    A[i, j] = beta_i exp(G_i - G_j) k_i.k_j   (j a proper ancestor of i),   P = (Q K^T) * exp(G_i - G_j) * M
    U = (I + A)^-1 beta (V - exp(G) K S0),    O = exp(G) Q S0 + P U

``I + A`` is unit lower triangular (an ancestor has a smaller index). Rows go in blocks of 16 as
in the chunked kernels of flash-linear-attention (``chunk_gated_delta_rule``, ``solve_tril``;
Yang et al., arXiv 2406.06484): the prep kernel, per (value head, row block), writes the blocks
of A and P at or below the diagonal and the inverse of A's diagonal block (forward substitution
in registers); the solve kernel, per (value head, V tile), walks the row blocks in order:
``U_b = Dinv_b (R_b - sum_{c<b} A_bc U_c)`` and ``O_b = exp(G_b) Q_b S0 + sum_{c<=b} P_bc U_c``,
reading the solved U rows back from ``u`` (the cache's verify scratch, which the commit folds).
No per-node state is ever written; S0 is read, not changed. n is a runtime value (no recompiles
per tree size). Matmuls are exact fp32 (``precision`` ``ieee``; ptxas for sm_90: no register
spills with 8 warps and V tiles of 16, while ``tf32x3`` spills).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def unit_lower_inverse(a, r, c):
        """(I + a)^-1 for a strictly lower-triangular [16, 16] block (forward substitution)."""
        t = tl.where(r[:, None] == c[None, :], 1.0, 0.0)
        for s in tl.static_range(1, 16):
            a_s = tl.sum(tl.where(r[:, None] == s, a, 0.0), axis=0)  # row s of a, over columns j
            row = tl.where(c == s, 1.0, 0.0) - tl.sum(a_s[:, None] * t, axis=0)
            t = tl.where(r[:, None] == s, row[None, :], t)
        return t

    @triton.jit(do_not_specialize=["n", "NP"])  # one compile for every row count
    def _prep_kernel(q_ptr, k_ptr, g_ptr, beta_ptr, anc_ptr, kk_ptr, a_ptr, p_ptr, d_ptr,
                     n, NP, stride_g, stride_kk,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
                     PREC: tl.constexpr):
        h = tl.program_id(0)
        b = tl.program_id(1)
        kh = h // (HV // HK)
        ar = tl.arange(0, 16)
        dk = tl.arange(0, BK)
        km = dk < DK
        r = b * 16 + ar
        rm = r < n
        kb = tl.load(k_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        qb = tl.load(q_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        gb = tl.load(g_ptr + r * stride_g + h, mask=rm, other=0.0)
        beta = tl.load(beta_ptr + r * HV + h, mask=rm, other=0.0)
        tl.store(kk_ptr + r[:, None] * stride_kk + h * DK + dk[None, :], kb, mask=rm[:, None] & km[None, :])
        for c in range(0, b + 1):
            cc = c * 16 + ar
            cm = cc < n
            kc = tl.load(k_ptr + (cc[:, None] * HK + kh) * DK + dk[None, :], mask=cm[:, None] & km[None, :],
                         other=0.0)
            gc = tl.load(g_ptr + cc * stride_g + h, mask=cm, other=0.0)
            on = tl.load(anc_ptr + r[:, None] * n + cc[None, :], mask=rm[:, None] & cm[None, :], other=0) != 0
            decay = tl.exp(tl.where(on, gb[:, None] - gc[None, :], float("-inf")))
            kk = tl.dot(kb, tl.trans(kc), input_precision=PREC)
            qk = tl.dot(qb, tl.trans(kc), input_precision=PREC)
            a = tl.where(on & (r[:, None] != cc[None, :]), kk * decay * beta[:, None], 0.0)
            blk = (h * NP + r[:, None]) * NP + cc[None, :]
            tl.store(a_ptr + blk, a)
            tl.store(p_ptr + blk, qk * decay)
            if c == b:
                tl.store(d_ptr + (h * NP + r[:, None]) * 16 + ar[None, :], unit_lower_inverse(a, ar, ar))

    @triton.jit(do_not_specialize=["n", "NB", "NP"])
    def _solve_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, a_ptr, p_ptr, d_ptr, u_ptr, o_ptr,
                      n, NB, NP, stride_g, stride_u,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
        h = tl.program_id(0)
        kh = h // (HV // HK)
        ar = tl.arange(0, 16)
        dk = tl.arange(0, BK)
        km = dk < DK
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        vm = dv < DV
        s0 = tl.load(s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :], mask=km[:, None] & vm[None, :], other=0.0)
        for b in range(0, NB):
            r = b * 16 + ar
            rm = r < n
            kb = tl.load(k_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :],
                         other=0.0)
            qb = tl.load(q_ptr + (r[:, None] * HK + kh) * DK + dk[None, :], mask=rm[:, None] & km[None, :],
                         other=0.0)
            vb = tl.load(v_ptr + (r[:, None] * HV + h) * DV + dv[None, :], mask=rm[:, None] & vm[None, :], other=0.0)
            eg = tl.exp(tl.load(g_ptr + r * stride_g + h, mask=rm, other=0.0))
            beta = tl.load(beta_ptr + r * HV + h, mask=rm, other=0.0)
            rhs = beta[:, None] * (vb - eg[:, None] * tl.dot(kb, s0, input_precision=PREC))
            out = eg[:, None] * tl.dot(qb, s0, input_precision=PREC)
            for c in range(0, b):
                cc = c * 16 + ar
                uc = tl.load(u_ptr + cc[:, None] * stride_u + h * DV + dv[None, :],
                             mask=(cc < n)[:, None] & vm[None, :], other=0.0)
                blk = (h * NP + r[:, None]) * NP + cc[None, :]
                rhs -= tl.dot(tl.load(a_ptr + blk), uc, input_precision=PREC)
                out += tl.dot(tl.load(p_ptr + blk), uc, input_precision=PREC)
            ub = tl.dot(tl.load(d_ptr + (h * NP + r[:, None]) * 16 + ar[None, :]), rhs, input_precision=PREC)
            pbb = tl.load(p_ptr + (h * NP + r[:, None]) * NP + (b * 16 + ar)[None, :])
            out += tl.dot(pbb, ub, input_precision=PREC)
            tl.store(u_ptr + r[:, None] * stride_u + h * DV + dv[None, :], ub, mask=rm[:, None] & vm[None, :])
            tl.store(o_ptr + (r[:, None] * HV + h) * DV + dv[None, :], out, mask=rm[:, None] & vm[None, :])
            tl.debug_barrier()  # the next row block reads these U rows back


def tree_rule(q: Tensor, k: Tensor, v: Tensor, G: Tensor, beta: Tensor, state: Tensor, anc: Tensor,
              kk: Tensor, u: Tensor, precision: str = "ieee", block_v: int = 16) -> Tensor:
    """All nodes of one block from ``state`` (read only). Returns o ``[n, Hv, Dv]`` fp32.

    q, k fp32 ``[n, Hk, Dk]`` (per key head; value head h uses key head ``h // (Hv/Hk)``), v fp32
    ``[n, Hv, Dv]``, G (path-cumsum gates) and beta fp32 ``[>= n, Hv]`` (unit last stride), state
    fp32 ``[Hv, Dk, Dv]`` contiguous, anc bool ``[n, n]`` ancestor-or-self mask (topological order).
    Written for the commit: kk ``[>= n, Hv, Dk]`` (k per value head) and u ``[>= n, Hv, Dv]``
    (both fp32, rows contiguous). Raises ValueError for shapes that do not fit."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk or tuple(state.shape) != (hv, dk, dv) or tuple(anc.shape) != (n, n):
        raise ValueError(f"tree_rule: q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}, "
                         f"anc {tuple(anc.shape)} do not fit")
    nb = triton.cdiv(n, 16)
    np_ = nb * 16
    dev = q.device
    a = torch.empty((hv, np_, np_), dtype=torch.float32, device=dev)
    p = torch.empty_like(a)
    d = torch.empty((hv, np_, 16), dtype=torch.float32, device=dev)
    o = torch.empty((n, hv, dv), dtype=torch.float32, device=dev)
    anc8 = anc.contiguous().view(torch.uint8)
    bk, bv = max(16, triton.next_power_of_2(dk)), max(16, min(block_v, triton.next_power_of_2(dv)))
    _prep_kernel[(hv, nb)](q, k, G, beta, anc8, kk, a, p, d, n, np_, G.stride(0), kk.stride(0),
                           HK=hk, HV=hv, DK=dk, BK=bk, PREC=precision, num_warps=4)
    _solve_kernel[(hv, triton.cdiv(dv, bv))](q, k, v, G, beta, state, a, p, d, u, o, n, nb, np_, G.stride(0),
                                             u.stride(0), HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv,
                                             PREC=precision, num_warps=8)
    return o
