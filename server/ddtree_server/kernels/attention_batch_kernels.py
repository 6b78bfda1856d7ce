"""Triton programs of kernels/attention_batch.py: the split-K attention of attention_kernels.py with a
request axis. Program (split, request * kv_heads + kv head, row block) reads request r's live
length ``start[r]``, its query rows ``[qo[r], qo[r + 1])`` and its slot's cache
``k[slot[r], head]``; key tiles and split boundaries are those of the one-request kernel for the
same live length (``per_split``), so a request's rows are bitwise those it gets alone. ``MODE`` 2
(a DFlash draft block: every row of the block visible) and ``WINDOWED`` (sliding-window layers)
follow the one-request kernel's rules.

``PAGED``: the cache is a page pool ``[pages, kv_heads, PAGE, d]`` instead of a slot pool, and
request r's row j lives in page ``pages[r, j // PAGE]`` at row ``j % PAGE``; tiles, splits and the
arithmetic are the same, only the addresses differ (so paged rows are bitwise the slot pool's).
``VARIANT`` > 0 picks another address path of the page pool (attention_paged_kernels.py)."""

import triton
import triton.language as tl

from ddtree_server.kernels.attention_kernels import online_step, per_split, tile_visible, window_span
from ddtree_server.kernels.attention_paged_kernels import paged_kv, split_page_ids, tile_page_ids


@triton.jit
def row_offsets(j, r, pages_ptr, stride_pr, stride_ks, stride_kr, stride_vs, stride_vr, ok,
                PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Element offsets of key rows ``j`` of request r in K and in V from their base pointers (slot
    pool: the slot's base; page pool: the pool's, one page-table read for both; rows outside
    ``ok`` read page 0)."""
    if PAGED:
        page = tl.load(pages_ptr + r * stride_pr + j // PAGE, mask=ok, other=0).to(tl.int64)
        within = j % PAGE
        return page * stride_ks + within * stride_kr, page * stride_vs + within * stride_vr
    else:
        return j * stride_kr, j * stride_vr


@triton.jit
def batch_split_kernel(q_ptr, k_ptr, v_ptr, start_ptr, qo_ptr, slot_ptr, pages_ptr, mask_ptr, o_ptr, po_ptr, pl_ptr,
                       HKV, rep, stride_qn, stride_qh, stride_ks, stride_kh, stride_kr, stride_vs, stride_vh,
                       stride_vr, stride_pr, stride_mb, stride_mn, stride_on, stride_oh, m_pad, scale_log2,
                       window, MODE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, PAGED: tl.constexpr,
                       PAGE: tl.constexpr, WINDOWED: tl.constexpr, VARIANT: tl.constexpr = 0,
                       KV_SAME: tl.constexpr = False, PRE_IDS: tl.constexpr = 64):
    ALT: tl.constexpr = PAGED and VARIANT > 0                 # an alternative page address path
    PRELOAD: tl.constexpr = ALT and VARIANT == 4
    G: tl.constexpr = BLOCK_N // PAGE if ALT else 1
    pid_s, pid_hr, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, h = pid_hr // HKV, pid_hr % HKV
    s = tl.load(start_ptr + r).to(tl.int32)
    q0 = tl.load(qo_ptr + r).to(tl.int32)
    N = tl.load(qo_ptr + r + 1).to(tl.int32) - q0
    if PAGED:
        slot = 0
    else:
        slot = tl.load(slot_ptr + r).to(tl.int64)
    length = s + N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok, head = rows // rep, h * rep + rows % rep
    row_ok = tok < N
    dd = tl.arange(0, D)
    if not PRELOAD:
        q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
                    mask=row_ok[:, None], other=0.0)
    per = per_split(length, BLOCK_N, SPLITS)
    lo = pid_s * per * BLOCK_N
    last = tl.maximum(tl.minimum(N - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // rep), 0)
    hi = tl.minimum(lo + per * BLOCK_N, length)
    free = s   # keys below `free` are visible to every row
    if MODE != 2:   # nothing past the block row of the row block's last token is visible
        hi = tl.minimum(hi, s + last + 1)
    if WINDOWED:   # every tile masked; skip the tiles wholly outside the window of every row
        free = 0
        lo, hi = window_span(lo, hi, s, (pid_m * BLOCK_M) // rep, last, window, BLOCK_N, MODE)
    pre = tl.maximum(lo, tl.minimum(hi, free // BLOCK_N * BLOCK_N))
    pre_ids, fits = 0, False
    if PRELOAD:   # the split's page ids first, then q: the two reads overlap
        pre_ids, fits = split_page_ids(lo, hi, r, pages_ptr, stride_pr, PAGE, G, PRE_IDS)
        q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
                    mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kb = k_ptr + slot * stride_ks + h * stride_kh
    vb = v_ptr + slot * stride_vs + h * stride_vh
    for t in range(lo, pre, BLOCK_N):  # whole tiles of the committed prefix: no mask
        if ALT:
            ids = tile_page_ids(t, lo, hi, r, pages_ptr, stride_pr, pre_ids, fits, PAGE, G, PRE_IDS, PRELOAD)
            k, v = paged_kv(kb, vb, ids, t, hi, dd, stride_ks, stride_kr, stride_vs, stride_vr, False, PAGE, G, D,
                            KV_SAME)
        else:
            j = t + tl.arange(0, BLOCK_N)
            jk, jv = row_offsets(j, r, pages_ptr, stride_pr, stride_ks, stride_kr, stride_vs, stride_vr, j >= 0,
                                 PAGED, PAGE)
            k = tl.load(kb + jk[:, None] + dd[None, :])
            v = tl.load(vb + jv[:, None] + dd[None, :])
        m_i, l_i, acc = online_step(q, k, v, m_i, l_i, acc, 0, scale_log2, False, PREC)
    for t in range(pre, hi, BLOCK_N):
        j = t + tl.arange(0, BLOCK_N)
        kin = j < hi
        if ALT:
            ids = tile_page_ids(t, lo, hi, r, pages_ptr, stride_pr, pre_ids, fits, PAGE, G, PRE_IDS, PRELOAD)
            k, v = paged_kv(kb, vb, ids, t, hi, dd, stride_ks, stride_kr, stride_vs, stride_vr, True, PAGE, G, D,
                            KV_SAME)
        else:
            jk, jv = row_offsets(j, r, pages_ptr, stride_pr, stride_ks, stride_kr, stride_vs, stride_vr, kin,
                                 PAGED, PAGE)
            k = tl.load(kb + jk[:, None] + dd[None, :], mask=kin[:, None], other=0.0)
            v = tl.load(vb + jv[:, None] + dd[None, :], mask=kin[:, None], other=0.0)
        vis = tile_visible(j - s, tok, kin, row_ok, N, mask_ptr + r * stride_mb, stride_mn, window, MODE, WINDOWED)
        m_i, l_i, acc = online_step(q, k, v, m_i, l_i, acc, vis & kin[None, :], scale_log2, True, PREC)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SPLITS == 1:
        tl.store(o_ptr + (q0 + tok)[:, None] * stride_on + head[:, None] * stride_oh + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        base = (pid_s * tl.num_programs(1) + pid_hr) * m_pad + rows
        tl.store(po_ptr + base[:, None] * D + dd[None, :], out)
        tl.store(pl_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)))


@triton.jit
def batch_merge_kernel(po_ptr, pl_ptr, o_ptr, start_ptr, qo_ptr, HKV, rep, stride_on, stride_oh, m_pad,
                       SPLITS: tl.constexpr, SP2: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    row, pid_hr = tl.program_id(0), tl.program_id(1)
    r, h = pid_hr // HKV, pid_hr % HKV
    q0 = tl.load(qo_ptr + r).to(tl.int32)
    N = tl.load(qo_ptr + r + 1).to(tl.int32) - q0
    if row // rep < N:
        length = tl.load(start_ptr + r).to(tl.int32) + N
        per = per_split(length, BLOCK_N, SPLITS)
        used = tl.cdiv(tl.cdiv(length, BLOCK_N), per)
        sp = tl.arange(0, SP2)
        base = (sp * tl.num_programs(1) + pid_hr) * m_pad + row
        ok = sp < used
        lse = tl.load(pl_ptr + base, mask=ok, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
        dd = tl.arange(0, D)
        part = tl.load(po_ptr + base[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        wsum = tl.sum(w, 0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(wsum == 0.0, 1.0, wsum)
        tl.store(o_ptr + (q0 + row // rep) * stride_on + (h * rep + row % rep) * stride_oh + dd,
                 out.to(o_ptr.dtype.element_ty))
