"""Decode / tree-verify attention over the static KV cache, split over the key length (Triton).

Batch-1 decoding asks attention for a few query rows against a long cached prefix: one query
token (or a 16-80 node tree) per KV head. A fused attention kernel that gives each program a
block of query rows launches only ``kv_heads`` programs there, each streaming every key alone.
Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023) splits the keys
over many programs instead and merges their partial softmaxes; this module does that:

* ``_split_kernel``: program (split, kv head, row block) runs the online softmax (fp32, Milakov &
  Gimelshein 2018) over its share of the keys ``[0, start + n)`` of ONE KV head; its rows are the
  ``rep`` query heads of that KV head for each query token (GQA: each K/V tile is read once for
  all of them). The cache ``[kv_heads, rows, head_dim]`` is read in place and only up to the live
  length, which comes from the device scalar ``start`` (so one CUDA graph serves every length).
* ``_merge_kernel``: combines the splits' (output, log-sum-exp) pairs; skipped with one split.
  Opt-in (``AttnConfig.fused_merge``): no second launch; the split programs of one (KV head, row
  block) count themselves on a device counter (acq_rel atomic) and the last one merges and resets
  it, the "last block" reduction pattern of split-K / stream-K GEMMs.

Visibility of key ``j`` for query token ``i`` (``s = start``): keys ``j < s`` always; inside the
new block ``[s, s + n)``: ``causal`` j - s <= i, ``tree`` ``block[i, j - s]`` (ancestor-or-self
mask ``[n, n]``), ``full`` every key (the DFlash drafter's non-causal block).
Reference: ``attention_ref`` (torch, fp32 softmax); CPU tests run the kernels under
``TRITON_INTERPRET=1`` against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_server.kernels.runtime import HAVE_TRITON, sm_count

MODES = {"causal": 0, "tree": 1, "full": 2}
HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2E = 1.4426950408889634


def attention_ref(q: Tensor, k: Tensor, v: Tensor, start: int, mode: str = "causal",
                  block: Tensor | None = None, scale: float | None = None) -> Tensor:
    """q ``[n, hq, d]``, k / v ``[hkv, rows, d]`` (one layer of the cache) -> ``[n, hq, d]`` in q's
    dtype. Keys ``[0, start + n)`` are read; visibility as in the module docstring."""
    n, hq, d = q.shape
    hkv, length = k.shape[0], start + n
    vis = torch.ones((n, length), dtype=torch.bool, device=q.device)
    if mode == "causal":
        vis[:, start:] = torch.ones((n, n), dtype=torch.bool, device=q.device).tril_()
    elif mode == "tree":
        vis[:, start:] = block.bool()
    kk = k[:, :length].float().repeat_interleave(hq // hkv, 0)
    vv = v[:, :length].float().repeat_interleave(hq // hkv, 0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), kk) * (scale if scale is not None else d ** -0.5)
    p = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    return torch.einsum("hnl,hld->nhd", p, vv).to(q.dtype)


@dataclass(frozen=True)
class AttnConfig:
    """Launch settings: key tile, warps, pipeline stages, programs aimed at per SM, split cap."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: float = 2.0
    max_splits: int = 64
    fused_merge: bool = False

    @property
    def name(self) -> str:
        return f"n{self.block_n}w{self.num_warps}s{self.num_stages}c{self.ctas_per_sm:g}" + "f" * self.fused_merge


DEFAULT = AttnConfig()


def plan(n: int, rep: int, kv_heads: int, head_dim: int, rows: int, device, cfg: AttnConfig = DEFAULT
         ) -> tuple[int, int, int]:
    """(block_m, block_n, splits) for n query tokens: row blocks of the ``n * rep`` rows of one
    KV head, and enough key splits that all programs together fill ``ctas_per_sm`` per SM. The
    split count depends on the shape only (not the live length), so a CUDA graph can hold it."""
    m_rows = n * rep
    block_m = 16 if m_rows <= 16 else 32 if m_rows <= 32 else 64
    block_n = cfg.block_n
    if head_dim >= 256:
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    programs = kv_heads * math.ceil(m_rows / block_m)
    want = math.ceil(cfg.ctas_per_sm * sm_count(device) / programs)
    return block_m, block_n, max(1, min(want, cfg.max_splits, math.ceil(rows / block_n)))


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _online(q, k, v, m_i, l_i, acc, vis, scale_log2, MASKED: tl.constexpr, PREC: tl.constexpr):
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        if MASKED:
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_sub[:, None])
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        return m_new, l_i, acc

    @triton.jit
    def _merge_rows(po_ptr, pl_ptr, o_ptr, h, heads, rows, length, N, rep, stride_on, stride_oh, m_pad,
                    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        # the fused merge (last split program): partials written by other programs, read past L1
        per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS)
        used = tl.cdiv(tl.cdiv(length, BLOCK_N), per)  # splits that got keys
        tok, head = rows // rep, h * rep + rows % rep
        dd = tl.arange(0, D)
        mx = tl.full(rows.shape, float("-inf"), tl.float32)
        for sp in range(0, used):
            mx = tl.maximum(mx, tl.load(pl_ptr + (sp * heads + h) * m_pad + rows, cache_modifier=".cg"))
        m_sub = tl.where(mx == float("-inf"), 0.0, mx)
        acc = tl.zeros([rows.shape[0], D], tl.float32)
        wsum = tl.zeros(rows.shape, tl.float32)
        for sp in range(0, used):
            base = (sp * heads + h) * m_pad + rows
            w = tl.exp2(tl.load(pl_ptr + base, cache_modifier=".cg") - m_sub)
            acc += w[:, None] * tl.load(po_ptr + base[:, None] * D + dd[None, :], cache_modifier=".cg")
            wsum += w
        out = acc / tl.where(wsum == 0.0, 1.0, wsum)[:, None]
        tl.store(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(tok < N)[:, None])

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, start_ptr, mask_ptr, o_ptr, po_ptr, pl_ptr, cnt_ptr, N, rep,
                      stride_qn, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_mn,
                      stride_on, stride_oh, m_pad, scale_log2,
                      MODE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, FUSED: tl.constexpr):
        pid_s, h, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s = tl.load(start_ptr).to(tl.int32)
        length = s + N
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tok, head = rows // rep, h * rep + rows % rep
        row_ok = tok < N
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
                    mask=row_ok[:, None], other=0.0)
        per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS)  # key tiles per split
        lo = pid_s * per * BLOCK_N
        hi = tl.minimum(lo + per * BLOCK_N, length)
        free = length  # keys below `free` are visible to every row
        if MODE != 2:  # nothing past the block row of the block's last token is visible
            free = s
            hi = tl.minimum(hi, s + tl.minimum(N - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // rep) + 1)
        pre = tl.maximum(lo, tl.minimum(hi, free // BLOCK_N * BLOCK_N))
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        kb, vb = k_ptr + h * stride_kh, v_ptr + h * stride_vh
        for t in range(lo, pre, BLOCK_N):  # whole tiles of always-visible keys: no mask
            j = t + tl.arange(0, BLOCK_N)
            k = tl.load(kb + j[:, None] * stride_kr + dd[None, :])
            v = tl.load(vb + j[:, None] * stride_vr + dd[None, :])
            m_i, l_i, acc = _online(q, k, v, m_i, l_i, acc, 0, scale_log2, False, PREC)
        for t in range(pre, hi, BLOCK_N):
            j = t + tl.arange(0, BLOCK_N)
            kin = j < hi
            k = tl.load(kb + j[:, None] * stride_kr + dd[None, :], mask=kin[:, None], other=0.0)
            v = tl.load(vb + j[:, None] * stride_vr + dd[None, :], mask=kin[:, None], other=0.0)
            rel = j - s
            if MODE == 0:
                vis = rel[None, :] <= tok[:, None]
            elif MODE == 1:
                inb = (rel >= 0)[None, :] & kin[None, :] & row_ok[:, None]
                bm = tl.load(mask_ptr + tok[:, None] * stride_mn + rel[None, :], mask=inb, other=0)
                vis = (rel < 0)[None, :] | (bm != 0)
            else:
                vis = rel[None, :] < N
            m_i, l_i, acc = _online(q, k, v, m_i, l_i, acc, vis & kin[None, :], scale_log2, True, PREC)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if SPLITS == 1:
            tl.store(o_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + dd[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            base = (pid_s * tl.num_programs(1) + h) * m_pad + rows
            tl.store(po_ptr + base[:, None] * D + dd[None, :], out)
            tl.store(pl_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)))
            if FUSED:  # the last split of this (head, row block) to finish merges them all
                tl.debug_barrier()  # every thread's partial stores precede the release below
                slot = cnt_ptr + h * tl.num_programs(2) + pid_m
                if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                    tl.store(slot, 0)  # ready for the next launch (CUDA graph replays included)
                    _merge_rows(po_ptr, pl_ptr, o_ptr, h, tl.num_programs(1), rows, length, N, rep, stride_on,
                                stride_oh, m_pad, SPLITS, BLOCK_N, D)

    @triton.jit
    def _merge_kernel(po_ptr, pl_ptr, o_ptr, start_ptr, N, rep, stride_on, stride_oh, m_pad,
                      SPLITS: tl.constexpr, SP2: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
        # one program per (query row, KV head): all splits' partials in ONE load each (no loop of
        # dependent round trips to memory)
        row, h = tl.program_id(0), tl.program_id(1)
        length = tl.load(start_ptr).to(tl.int32) + N
        per = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS)
        used = tl.cdiv(tl.cdiv(length, BLOCK_N), per)
        sp = tl.arange(0, SP2)
        base = (sp * tl.num_programs(1) + h) * m_pad + row
        ok = sp < used
        lse = tl.load(pl_ptr + base, mask=ok, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
        dd = tl.arange(0, D)
        part = tl.load(po_ptr + base[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        wsum = tl.sum(w, 0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(wsum == 0.0, 1.0, wsum)
        tl.store(o_ptr + (row // rep) * stride_on + (h * rep + row % rep) * stride_oh + dd,
                 out.to(o_ptr.dtype.element_ty))


_COUNTERS: dict = {}


def _counters(device: torch.device, count: int) -> Tensor:
    """Zeroed int32 counters of the fused merge, one per (KV head, row block); shared by every call
    on the device (launches on one stream run one after the other, and each leaves them at 0)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < count:
        buf = _COUNTERS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return buf


def supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``decode_attention`` handles this head size and dtype."""
    return HAVE_TRITON and head_dim in HEAD_DIMS and dtype in (torch.float32, torch.float16, torch.bfloat16)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, start: Tensor, mode: str = "causal",
                     block: Tensor | None = None, scale: float | None = None, out: Tensor | None = None,
                     config: AttnConfig = DEFAULT) -> Tensor:
    """Attention of ``n`` new query tokens over the cache, as ``attention_ref`` computes it.

    Args:
        q: ``[n, hq, d]`` queries (last axis contiguous; other strides free).
        k, v: ``[hkv, rows, d]`` one layer of the static cache (hq a multiple of hkv), holding the
            new block's keys / values at rows ``[start, start + n)`` already.
        start: 0-d integer tensor on q's device: cached rows before the block (read on device).
        mode: ``causal`` | ``tree`` | ``full`` (module docstring); ``block``: bool / uint8
            ``[n, n]`` ancestor-or-self mask for ``tree``.
        scale: softmax scale (default ``d ** -0.5``); out: optional ``[n, hq, d]`` result buffer.
    Returns:
        ``[n, hq, d]`` in q's dtype (contiguous unless ``out`` is given).
    Raises:
        ValueError: mismatched shapes, dtypes or devices, unsupported head size, unknown mode.
        RuntimeError: Triton is not installed.
    """
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[0]:
        raise ValueError(f"need q [n, hq, d] and k / v [hkv, rows, d] with hkv | hq, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n, hq, d = q.shape
    hkv, rows = k.shape[0], k.shape[1]
    if not supported(d, q.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"unsupported head_dim {d} or dtypes {q.dtype}/{k.dtype}/{v.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k and v need a contiguous last axis")
    if start.dim() != 0 or start.device != q.device or k.device != q.device:
        raise ValueError("start must be a 0-d tensor on the device of q, k and v")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if mode == "tree":
        if block is None or tuple(block.shape) != (n, n) or block.stride(1) != 1:
            raise ValueError(f"mode 'tree' needs a row-major block mask [{n}, {n}]")
        block = block.view(torch.uint8) if block.dtype == torch.bool else block
    rep = hq // hkv
    block_m, block_n, splits = plan(n, rep, hkv, d, rows, q.device, config)
    m_tiles = math.ceil(n * rep / block_m)
    m_pad = m_tiles * block_m
    if out is None:
        out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    po = pl = out
    if splits > 1:
        po = torch.empty((splits, hkv, m_pad, d), dtype=torch.float32, device=q.device)
        pl = torch.empty((splits, hkv, m_pad), dtype=torch.float32, device=q.device)
    mask = block if mode == "tree" else start
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = (scale if scale is not None else d ** -0.5) * LOG2E
    fused = config.fused_merge and splits > 1
    cnt = _counters(q.device, hkv * m_tiles) if fused else start
    _split_kernel[(splits, hkv, m_tiles)](
        q, k, v, start, mask, out, po, pl, cnt, n, rep, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), mask.stride(0) if mode == "tree" else 0, out.stride(0), out.stride(1),
        m_pad, scale_log2, MODE=MODES[mode], SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        PREC=prec, FUSED=fused, num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1 and not fused:
        _merge_kernel[(n * rep, hkv)](po, pl, out, start, n, rep, out.stride(0), out.stride(1), m_pad,
                                      SPLITS=splits, SP2=triton.next_power_of_2(splits), BLOCK_N=block_n, D=d,
                                      num_warps=4)
    return out
