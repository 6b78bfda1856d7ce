"""Fused small kernels of a decoder layer (Triton), each with a pure-torch reference.

* ``qkv_prep``: per-head q / k RMSNorm (Qwen3; optional), RoPE in transformers' half-split layout
  (``x * cos + rotate_half(x) * sin``), the queries written to a ``[n, hq, d]`` buffer and the
  keys / values written straight into the static cache rows ``row0 + 0..n-1`` (``row0`` a device
  scalar): one launch instead of cat + norm + roll + mul + addcmul + two index_copy.
* ``silu_mul``: the SwiGLU product ``silu(gate) * up`` in one launch instead of two.
* ``rms_norm``: RMSNorm of rows, one program per row in a single pass (the row stays in registers).

Arithmetic in fp32 with a rounding to the tensor dtype where the eager ops round (after the
norm, after the activation), so results match the eager path up to fp32 rounding order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor, signed_sin: bool) -> Tensor:
    """x ``[n, h, d]``, cos / sin ``[n, d]`` -> RoPE'd x (fp32 math, x's dtype). ``signed_sin``:
    sin already carries rotate_half's sign (TargetModel), so out = x*cos + roll(x, d/2)*sin."""
    xf, c, s = x.float(), cos.float()[:, None], sin.float()[:, None]
    half = x.shape[-1] // 2
    rot = xf.roll(half, dims=-1) if signed_sin else torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * c + rot * s).to(x.dtype)


def qkv_prep_ref(q: Tensor | None, k: Tensor, v: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
                 eps: float, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, row0: int,
                 signed_sin: bool = True) -> Tensor | None:
    """Torch version of ``qkv_prep`` (same arguments; row0 an int). Returns the queries."""
    def norm(x, w):
        return x if w is None else F.rms_norm(x.float(), (x.shape[-1],), w.to(x.dtype).float(), eps).to(x.dtype)

    n = k.shape[0]
    k_cache[:, row0:row0 + n] = rope_ref(norm(k, k_weight), cos, sin, signed_sin).transpose(0, 1)
    v_cache[:, row0:row0 + n] = v.transpose(0, 1)
    return None if q is None else rope_ref(norm(q, q_weight), cos, sin, signed_sin)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``F.rms_norm`` in fp32 with the weight cast to x's dtype first, rounded once to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.to(x.dtype).float(), eps).to(x.dtype)


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` with the activation rounded to the dtype first, as the eager ops do."""
    return (F.silu(gate.float()).to(gate.dtype).float() * up.float()).to(gate.dtype)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prep_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, row0_ptr, qo_ptr, kc_ptr, vc_ptr,
                     HQ, HKV, s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_cn, s_sn, s_on, s_oh, s_kch, s_kcr,
                     s_vch, s_vcr, eps, NORM: tl.constexpr, SIGNED: tl.constexpr, D: tl.constexpr,
                     HB: tl.constexpr, ROWS: tl.constexpr):
        # program (token i, block of HB heads of the concatenation q | k | v); each row is one
        # head: three masked loads / stores pick its source and destination (no pointer select)
        i = tl.program_id(0).to(tl.int64)  # token * row stride passes 2**31 in long prompts
        hh = tl.program_id(1) * HB + tl.arange(0, HB)
        is_q, is_k = hh < HQ, (hh >= HQ) & (hh < HQ + HKV)
        is_v = (hh >= HQ + HKV) & (hh < HQ + 2 * HKV)
        hk, hv = tl.where(is_k, hh - HQ, 0), tl.where(is_v, hh - HQ - HKV, 0)
        hq = tl.where(is_q, hh, 0)
        lo, hi = tl.arange(0, D // 2)[None, :], D // 2 + tl.arange(0, D // 2)[None, :]
        q_src = q_ptr + i * s_qn + hq[:, None] * s_qh
        k_src = k_ptr + i * s_kn + hk[:, None] * s_kh
        v_src = v_ptr + i * s_vn + hv[:, None] * s_vh
        mq, mk, mv = is_q[:, None], is_k[:, None], is_v[:, None]
        dt = k_ptr.dtype.element_ty
        a = tl.load(q_src + lo, mask=mq, other=0.0).to(tl.float32) \
            + tl.load(k_src + lo, mask=mk, other=0.0).to(tl.float32) \
            + tl.load(v_src + lo, mask=mv, other=0.0).to(tl.float32)  # exact: two of three are 0
        b = tl.load(q_src + hi, mask=mq, other=0.0).to(tl.float32) \
            + tl.load(k_src + hi, mask=mk, other=0.0).to(tl.float32) \
            + tl.load(v_src + hi, mask=mv, other=0.0).to(tl.float32)
        x1, x2 = a.to(dt), b.to(dt)
        if NORM:
            rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]
            w1 = tl.where(mq, tl.load(qw_ptr + lo), tl.load(kw_ptr + lo)).to(dt).to(tl.float32)
            w2 = tl.where(mq, tl.load(qw_ptr + hi), tl.load(kw_ptr + hi)).to(dt).to(tl.float32)
            a = (a * rstd * w1).to(dt).to(tl.float32)
            b = (b * rstd * w2).to(dt).to(tl.float32)
        c1 = tl.load(cos_ptr + i * s_cn + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + i * s_cn + hi).to(tl.float32)
        s1 = tl.load(sin_ptr + i * s_sn + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + i * s_sn + hi).to(tl.float32)
        if SIGNED:  # sin = [-sin, sin] already
            o1 = a * c1 + b * s1
        else:
            o1 = a * c1 - b * s1
        o2 = b * c2 + a * s2
        o1, o2 = tl.where(mv, x1, o1.to(dt)), tl.where(mv, x2, o2.to(dt))
        q_dst = qo_ptr + i * s_on + hq[:, None] * s_oh
        if ROWS:   # token i's own destination: an element offset into a pool layer (slot / page, row)
            off = tl.load(row0_ptr + i).to(tl.int64)
            k_dst = kc_ptr + hk.to(tl.int64)[:, None] * s_kch + off
            v_dst = vc_ptr + hv.to(tl.int64)[:, None] * s_vch + off
        else:
            row = tl.load(row0_ptr).to(tl.int64) + i
            k_dst = kc_ptr + hk.to(tl.int64)[:, None] * s_kch + row * s_kcr
            v_dst = vc_ptr + hv.to(tl.int64)[:, None] * s_vch + row * s_vcr
        tl.store(q_dst + lo, o1, mask=mq)
        tl.store(q_dst + hi, o2, mask=mq)
        tl.store(k_dst + lo, o1, mask=mk)
        tl.store(k_dst + hi, o2, mask=mk)
        tl.store(v_dst + lo, o1, mask=mv)
        tl.store(v_dst + hi, o2, mask=mv)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, width, s_xn, s_on, eps, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < width
        x = tl.load(x_ptr + i * s_xn + c, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 0) / width + eps)
        w = tl.load(w_ptr + c, mask=ok, other=0.0).to(x.dtype).to(tl.float32)
        tl.store(o_ptr + i * s_on + c, (xf * rstd * w).to(x.dtype), mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, width, s_gn, s_un, s_on, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)  # a gate|up row of Llama-3.1-8B x 75k tokens passes 2**31
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < width
        g = tl.load(g_ptr + i * s_gn + c, mask=ok, other=0.0)
        u = tl.load(u_ptr + i * s_un + c, mask=ok, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
        tl.store(o_ptr + i * s_on + c, (act * u).to(g.dtype), mask=ok)


def _inputs_ok(q, k, v, q_weight, k_weight, cos, sin) -> bool:
    """The shapes ``qkv_prep`` and ``qkv_prep_rows`` share: q ``[n, hq, d]`` (or None), k and v
    ``[n, hkv, d]``, d a power of two >= 4, cos / sin of width d, both norm weights or neither."""
    n, _, d = k.shape
    return (v.shape == k.shape and (q is None or (q.shape[0] == n and q.shape[2] == d)) and not d & (d - 1)
            and d >= 4 and cos.shape[-1] == d and sin.shape[-1] == d and (q_weight is None) == (k_weight is None))


def _rows_ok(*tensors: Tensor | None) -> bool:
    return all(t is None or t.stride(-1) == 1 for t in tensors)


def qkv_prep(q: Tensor | None, k: Tensor, v: Tensor, q_weight: Tensor | None, k_weight: Tensor | None,
             eps: float, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, row0: Tensor,
             signed_sin: bool = True, q_out: Tensor | None = None) -> Tensor | None:
    """Norm + RoPE the new queries and keys, write keys and values into the cache, in one launch.

    Args:
        q: ``[n, hq, d]`` or None (keys / values only); k, v: ``[n, hkv, d]`` (views of the fused
            projection are fine: any strides with a contiguous last axis).
        q_weight, k_weight: ``[d]`` per-head RMSNorm weights (both or neither; cast to the
            input dtype first), eps: its epsilon.
        cos, sin: ``[n, d]`` (token stride free) in the half-split layout; ``signed_sin``: sin is
            ``[-sin, sin]`` already (TargetModel._rope) rather than plain (drafter tables).
        k_cache, v_cache: ``[hkv, rows, d]`` one layer of the cache; row0: 0-d integer tensor on
            the device, the cache row of token 0.
        q_out: optional ``[n, hq, d]`` buffer for the queries.
    Returns:
        the queries ``[n, hq, d]`` (None when q is None).
    Raises:
        ValueError: mismatched shapes / devices, an odd or non-power-of-two head size.
        RuntimeError: Triton is not installed.
    """
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    n, hkv, d = k.shape
    if (not _inputs_ok(q, k, v, q_weight, k_weight, cos, sin)
            or k_cache.shape[0] != hkv or k_cache.shape[2] != d or v_cache.shape != k_cache.shape):
        raise ValueError(f"qkv_prep: bad shapes q {None if q is None else tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, cos {tuple(cos.shape)}")
    if not _rows_ok(q, k, v, cos, sin, k_cache, v_cache) or row0.dim() != 0 or row0.device != k.device:
        raise ValueError("qkv_prep: last axes must be contiguous and row0 a 0-d tensor on k's device")
    return _launch(q, k, v, q_weight, k_weight, eps, cos, sin, k_cache, v_cache, row0, signed_sin, q_out,
                   (k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)), False)


def qkv_prep_rows(q: Tensor, k: Tensor, v: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float,
                  cos: Tensor, sin: Tensor, k_pool: Tensor, v_pool: Tensor, offsets: Tensor,
                  signed_sin: bool = True) -> Tensor:
    """``qkv_prep`` with a destination per token, for a batch's rows: token i's keys / values go to
    element offset ``offsets[i]`` (int64 ``[n]``, head 0) of one pool layer ``k_pool`` / ``v_pool``
    ``[X, hkv, R, d]`` (a slot pool's ``[slots, hkv, rows, d]``: slot * stride(0) + row * stride(2);
    a page pool's ``[pages, hkv, page_size, d]``: page * stride(0) + row in page * stride(2)). The
    two pools must share their strides. Same math as ``qkv_prep``; returns the queries ``[n, hq, d]``."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    n, hkv, d = k.shape
    if (k_pool.dim() != 4 or k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride()
            or k_pool.shape[1] != hkv or k_pool.shape[3] != d or offsets.shape != (n,) or offsets.dtype != torch.long
            or offsets.device != k.device):
        raise ValueError(f"qkv_prep_rows: need pools [X, {hkv}, R, {d}] of equal strides and int64 offsets [{n}] "
                         f"on k's device, got {tuple(k_pool.shape)} / {tuple(v_pool.shape)} and {tuple(offsets.shape)}")
    if not _inputs_ok(q, k, v, q_weight, k_weight, cos, sin):
        raise ValueError(f"qkv_prep_rows: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not _rows_ok(q, k, v, cos, sin, k_pool, v_pool):
        raise ValueError("qkv_prep_rows: last axes must be contiguous")
    return _launch(q, k, v, q_weight, k_weight, eps, cos, sin, k_pool, v_pool, offsets, signed_sin, None, (k_pool.stride(1), 0, v_pool.stride(1), 0), True)


def _launch(q, k, v, q_weight, k_weight, eps, cos, sin, k_dst, v_dst, rows, signed_sin, q_out, strides, per_row):
    """One ``_prep_kernel`` launch; ``strides``: the destinations' (K head, K row, V head, V row)."""
    n, hkv, d = k.shape
    hq = 0 if q is None else q.shape[1]
    cos, sin = cos.reshape(n, d), sin.reshape(n, d)
    if q is not None and q_out is None:
        q_out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    qq, qo = (q, q_out) if q is not None else (k, k)
    qw, kw = (q_weight, k_weight) if k_weight is not None else (cos, cos)
    hb = 8
    s_kch, s_kcr, s_vch, s_vcr = strides
    _prep_kernel[(n, triton.cdiv(hq + 2 * hkv, hb))](
        qq, k, v, qw, kw, cos, sin, rows, qo, k_dst, v_dst, hq, hkv, qq.stride(0), qq.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), qo.stride(0),
        qo.stride(1), s_kch, s_kcr, s_vch, s_vcr, eps,
        NORM=k_weight is not None, SIGNED=signed_sin, D=d, HB=hb, ROWS=per_row, num_warps=2)
    return q_out


def silu_mul(gate: Tensor, up: Tensor, out: Tensor | None = None) -> Tensor:
    """``silu(gate) * up`` for ``[n, width]`` inputs (views of one fused projection are fine)
    -> ``[n, width]`` in gate's dtype. Raises ValueError for mismatched shapes."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    if gate.dim() != 2 or gate.shape != up.shape or not _rows_ok(gate, up):
        raise ValueError(f"silu_mul: need equal [n, width] inputs, got {tuple(gate.shape)} and {tuple(up.shape)}")
    n, width = gate.shape
    out = torch.empty_like(gate, memory_format=torch.contiguous_format) if out is None else out
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(width, block))](gate, up, out, width, gate.stride(0), up.stride(0),
                                                     out.stride(0), BLOCK=block, num_warps=4)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis of x ``[..., width]`` (contiguous last axis) with weight
    ``[width]`` (cast to x's dtype), statistics in fp32, as ``F.rms_norm``; returns x's shape and
    dtype. Raises ValueError for a weight of another width."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    width = x.shape[-1]
    if weight.shape != (width,) or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {width} (contiguous last axis)")
    rows = x.reshape(-1, width)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(width)
    warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, width, rows.stride(0), out.stride(0), eps, BLOCK=block,
                                       num_warps=warps)
    return out.view(x.shape)
