"""Gated delta rule kernels that update the committed recurrent state IN PLACE (fp32), each with
its pure-torch reference in ``models/hybrid/delta.py`` (docs/hybrid.md section 2):

* ``step_rule``: one token (plain decoding), reference ``delta.step``. Per value head h, state
  ``S [Dk, Dv]``: ``S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q``
  (Yang, Kautz & Hatamizadeh, arXiv 2412.06464, eq. 10). One program per (value head, V tile):
  the tile's ``Dk x BV`` slice of S is read once and written once.
* ``fold_path``: the commit of an accepted root path of m nodes for ALL GDN layers in one launch,
  reference ``delta.fold``: ``S* = exp(G_leaf) S0 + sum_j exp(G_leaf - G_j) k_j u_j^T`` from the
  k, u, G that the tree verify kept (``HybridCache.kk / uu / GG``). One program per (layer, value
  head, V tile); m is a runtime value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
        h = tl.program_id(0)
        kh = h // (HV // HK)
        dk = tl.arange(0, BK)
        km = dk < DK
        dv = tl.program_id(1) * BV + tl.arange(0, BV)
        vm = dv < DV
        q = tl.load(q_ptr + kh * DK + dk, mask=km, other=0.0)
        k = tl.load(k_ptr + kh * DK + dk, mask=km, other=0.0)
        v = tl.load(v_ptr + h * DV + dv, mask=vm, other=0.0)
        g = tl.load(g_ptr + h)
        beta = tl.load(beta_ptr + h)
        ptrs = s_ptr + h * DK * DV + dk[:, None] * DV + dv[None, :]
        msk = km[:, None] & vm[None, :]
        s = tl.load(ptrs, mask=msk, other=0.0) * tl.exp(g)
        u = (v - tl.sum(k[:, None] * s, axis=0)) * beta
        s = s + k[:, None] * u[None, :]
        tl.store(ptrs, s, mask=msk)
        tl.store(o_ptr + h * DV + dv, tl.sum(q[:, None] * s, axis=0), mask=vm)

    @triton.jit(do_not_specialize=["m"])  # one compile for every path length
    def _fold_kernel(s_ptr, kk_ptr, uu_ptr, gg_ptr, idx_ptr, m, layer_s, layer_kk, layer_uu, layer_g,
                     HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        li = tl.program_id(0)
        h = tl.program_id(1)
        dk = tl.arange(0, BK)
        km = dk < DK
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        vm = dv < DV
        g_layer = gg_ptr + li * layer_g
        leaf = tl.load(idx_ptr + m - 1)
        g_leaf = tl.load(g_layer + leaf * HV + h)
        upd = tl.zeros((BK, BV), dtype=tl.float32)
        for j in range(0, m):
            r = tl.load(idx_ptr + j)
            kj = tl.load(kk_ptr + li * layer_kk + (r * HV + h) * DK + dk, mask=km, other=0.0)
            uj = tl.load(uu_ptr + li * layer_uu + (r * HV + h) * DV + dv, mask=vm, other=0.0)
            kj = kj * tl.exp(g_leaf - tl.load(g_layer + r * HV + h))
            upd += kj[:, None] * uj[None, :]
        ptrs = s_ptr + li * layer_s + h * DK * DV + dk[:, None] * DV + dv[None, :]
        msk = km[:, None] & vm[None, :]
        tl.store(ptrs, tl.load(ptrs, mask=msk, other=0.0) * tl.exp(g_leaf) + upd, mask=msk)


def _tiles(dk: int, dv: int, block_v: int) -> tuple[int, int]:
    return triton.next_power_of_2(dk), min(block_v, triton.next_power_of_2(dv))


def step_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, block_v: int = 32) -> Tensor:
    """One token; ``state`` fp32 ``[Hv, Dk, Dv]`` (contiguous) is advanced in place.

    q, k fp32 ``[1, Hk, Dk]`` (per key head), v ``[1, Hv, Dv]``, g, beta ``[1, Hv]`` (contiguous
    rows). Returns o ``[1, Hv, Dv]`` fp32. Raises ValueError for shapes that do not fit."""
    _, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk or tuple(state.shape) != (hv, dk, dv) or not state.is_contiguous():
        raise ValueError(f"step_rule: q {tuple(q.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)} do not fit")
    bk, bv = _tiles(dk, dv, block_v)
    o = torch.empty((1, hv, dv), dtype=torch.float32, device=q.device)
    _step_kernel[(hv, triton.cdiv(dv, bv))](q, k, v, g, beta, state, o, HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=bv,
                                            num_warps=4)
    return o


def fold_path(state: Tensor, kk: Tensor, uu: Tensor, GG: Tensor, idx: Tensor, block_v: int = 32) -> None:
    """Commit the root path ``idx`` (long ``[m]`` on the device, root first, leaf last) into
    ``state`` ``[L, Hv, Dk, Dv]`` in place, from kk ``[L, cap, Hv, Dk]``, uu ``[L, cap, Hv, Dv]``,
    GG ``[L, cap, Hv]`` (all fp32, contiguous). Raises ValueError for an empty path or bad shapes."""
    n_layers, hv, dk, dv = state.shape
    m = idx.numel()
    if m == 0 or kk.shape[0] != n_layers or tuple(kk.shape[2:]) != (hv, dk) or tuple(uu.shape[2:]) != (hv, dv):
        raise ValueError(f"fold_path: state {tuple(state.shape)}, kk {tuple(kk.shape)}, uu {tuple(uu.shape)}, "
                         f"{m} path rows do not fit")
    if not all(t.is_contiguous() for t in (state, kk, uu, GG)):
        raise ValueError("fold_path needs contiguous state, kk, uu, GG")
    bk, bv = _tiles(dk, dv, block_v)
    _fold_kernel[(n_layers, hv, triton.cdiv(dv, bv))](
        state, kk, uu, GG, idx.contiguous(), m, state.stride(0), kk.stride(0), uu.stride(0), GG.stride(0),
        HV=hv, DK=dk, DV=dv, BK=bk, BV=bv, num_warps=4)
