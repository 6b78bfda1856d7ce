"""The Triton programs of kernels/attention.py (split-K decode / tree-verify attention): the online
softmax step, a tile's visibility and a window's key span (shared with the request-axis programs
of attention_batch_kernels.py), the split program, the merge program and the fused "last split
merges" path. See
kernels/attention.py for what they compute; ``decode_attention`` there launches them."""

import triton
import triton.language as tl


@triton.jit
def online_step(q, k, v, m_i, l_i, acc, vis, scale_log2, MASKED: tl.constexpr, PREC: tl.constexpr):
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
def per_split(length, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Key tiles per split: the power of two >= tiles / SPLITS. Split sp covers the keys
    [sp * per * BLOCK_N, (sp + 1) * per * BLOCK_N): boundaries at fixed multiples, which do not move
    while the live length grows inside a power-of-two bucket. A query row therefore sees its keys
    cut into the same pieces in a one-token step and in a 16-token chain verify, and both give the
    same bits (the softmax reduction order is the same)."""
    v = tl.cdiv(tl.cdiv(length, BLOCK_N), SPLITS) - 1
    v = v | (v >> 1)
    v = v | (v >> 2)
    v = v | (v >> 4)
    v = v | (v >> 8)
    v = v | (v >> 16)
    return v + 1


@triton.jit
def window_span(lo, hi, s, first, last, window, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """A sliding window's key tiles ``[lo, hi)`` of a split for the row block of tokens
    ``first .. last`` after ``s`` committed keys: tiles wholly outside every row's window skipped."""
    lo = tl.maximum(lo, (s + first - window + 1) // BLOCK_N * BLOCK_N)
    if MODE == 2:
        hi = tl.minimum(hi, s + last + window)
    return lo, hi


@triton.jit
def tile_visible(rel, tok, kin, row_ok, N, mask_ptr, stride_mn, window, MODE: tl.constexpr, WINDOWED: tl.constexpr):
    """Bool ``[rows, keys]``: which keys of a masked tile (``rel``: key position - s) each query
    token sees. MODE 0 causal, 1 tree (the block's mask rows at ``mask_ptr``), 2 block (every new
    row); ``WINDOWED``: keys ``window`` or more before the query hidden (and after it in block mode)."""
    if MODE == 0:
        vis = rel[None, :] <= tok[:, None]
    elif MODE == 1:
        inb = (rel >= 0)[None, :] & kin[None, :] & row_ok[:, None]
        bm = tl.load(mask_ptr + tok[:, None] * stride_mn + rel[None, :], mask=inb, other=0)
        vis = (rel < 0)[None, :] | (bm != 0)
    else:
        vis = rel[None, :] < N
    if WINDOWED:
        dist = tok[:, None] - rel[None, :]  # query position minus key position
        vis = vis & (dist < window)
        if MODE == 2:
            vis = vis & (-dist < window)
    return vis


@triton.jit
def _merge_rows(po_ptr, pl_ptr, o_ptr, h, heads, rows, length, N, rep, stride_on, stride_oh, m_pad,
                SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # the fused merge (last split program): partials written by other programs, read past L1
    per = per_split(length, BLOCK_N, SPLITS)
    used = tl.cdiv(tl.cdiv(length, BLOCK_N), per)  # splits that got keys
    tok, head = rows // rep, h * rep + rows % rep
    dd = tl.arange(0, D)
    mx = tl.full(rows.shape, float("-inf"), tl.float32)
    rows64 = rows.to(tl.int64)  # partial offsets pass 2**31 for long blocks: 64-bit (docs/architecture.md)
    for sp in range(0, used):
        mx = tl.maximum(mx, tl.load(pl_ptr + (sp * heads + h) * m_pad + rows64, cache_modifier=".cg"))
    m_sub = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([rows.shape[0], D], tl.float32)
    wsum = tl.zeros(rows.shape, tl.float32)
    for sp in range(0, used):
        base = (sp * heads + h) * m_pad + rows64
        w = tl.exp2(tl.load(pl_ptr + base, cache_modifier=".cg") - m_sub)
        acc += w[:, None] * tl.load(po_ptr + base[:, None] * D + dd[None, :], cache_modifier=".cg")
        wsum += w
    out = acc / tl.where(wsum == 0.0, 1.0, wsum)[:, None]
    tl.store(o_ptr + tok.to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=(tok < N)[:, None])


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, start_ptr, mask_ptr, o_ptr, po_ptr, pl_ptr, cnt_ptr, N, rep,
                  stride_qn, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_mn,
                  stride_on, stride_oh, m_pad, scale_log2, window,
                  MODE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr, FUSED: tl.constexpr,
                  WINDOWED: tl.constexpr):
    # row blocks on grid axis 0 (up to 2**31 - 1 programs; axes 1 and 2 stop at 65535)
    pid_m, h, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(start_ptr).to(tl.int32)
    length = s + N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok, head = rows // rep, h * rep + rows % rep
    row_ok = tok < N
    tok64 = tok.to(tl.int64)  # token * row stride passes 2**31 for long blocks of wide models
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + tok64[:, None] * stride_qn + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None], other=0.0)
    per = per_split(length, BLOCK_N, SPLITS)  # key tiles per split
    lo = pid_s * per * BLOCK_N
    hi = tl.minimum(lo + per * BLOCK_N, length)
    free = length  # keys below `free` are visible to every row
    last = tl.minimum(N - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // rep)  # last token of the row block
    if MODE != 2:  # nothing past the block row of the block's last token is visible
        free = s
        hi = tl.minimum(hi, s + last + 1)
    if WINDOWED:  # every tile masked; skip the tiles wholly outside the window of every row
        free = 0
        lo, hi = window_span(lo, hi, s, (pid_m * BLOCK_M) // rep, last, window, BLOCK_N, MODE)
    pre = tl.maximum(lo, tl.minimum(hi, free // BLOCK_N * BLOCK_N))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kb, vb = k_ptr + h.to(tl.int64) * stride_kh, v_ptr + h.to(tl.int64) * stride_vh
    for t in range(lo, pre, BLOCK_N):  # whole tiles of always-visible keys: no mask
        j = t + tl.arange(0, BLOCK_N)
        k = tl.load(kb + j[:, None] * stride_kr + dd[None, :])
        v = tl.load(vb + j[:, None] * stride_vr + dd[None, :])
        m_i, l_i, acc = online_step(q, k, v, m_i, l_i, acc, 0, scale_log2, False, PREC)
    for t in range(pre, hi, BLOCK_N):
        j = t + tl.arange(0, BLOCK_N)
        kin = j < hi
        k = tl.load(kb + j[:, None] * stride_kr + dd[None, :], mask=kin[:, None], other=0.0)
        v = tl.load(vb + j[:, None] * stride_vr + dd[None, :], mask=kin[:, None], other=0.0)
        vis = tile_visible(j - s, tok, kin, row_ok, N, mask_ptr, stride_mn, window, MODE, WINDOWED)
        m_i, l_i, acc = online_step(q, k, v, m_i, l_i, acc, vis & kin[None, :], scale_log2, True, PREC)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if SPLITS == 1:
        tl.store(o_ptr + tok64[:, None] * stride_on + head[:, None] * stride_oh + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # (split, head, row) of the partials: splits * heads * m_pad * D passes 2**31 elements for a
        # 16k-token block at the Qwen3-8B shape (the illegal memory access of docs/architecture.md)
        base = (pid_s * tl.num_programs(1) + h) * m_pad + rows.to(tl.int64)
        tl.store(po_ptr + base[:, None] * D + dd[None, :], out)
        tl.store(pl_ptr + base, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)))
        if FUSED:  # the last split of this (head, row block) to finish merges them all
            tl.debug_barrier()  # every thread's partial stores precede the release below
            slot = cnt_ptr + h * tl.num_programs(0) + pid_m
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.store(slot, 0)  # ready for the next launch (CUDA graph replays included)
                _merge_rows(po_ptr, pl_ptr, o_ptr, h, tl.num_programs(1), rows, length, N, rep, stride_on,
                            stride_oh, m_pad, SPLITS, BLOCK_N, D)


@triton.jit
def merge_kernel(po_ptr, pl_ptr, o_ptr, start_ptr, N, rep, stride_on, stride_oh, m_pad,
                  SPLITS: tl.constexpr, SP2: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # one program per (query row, KV head): all splits' partials in ONE load each (no loop of
    # dependent round trips to memory)
    row, h = tl.program_id(0), tl.program_id(1)
    length = tl.load(start_ptr).to(tl.int32) + N
    per = per_split(length, BLOCK_N, SPLITS)
    used = tl.cdiv(tl.cdiv(length, BLOCK_N), per)
    sp = tl.arange(0, SP2)
    base = (sp * tl.num_programs(1) + h) * m_pad + row.to(tl.int64)
    ok = sp < used
    lse = tl.load(pl_ptr + base, mask=ok, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
    dd = tl.arange(0, D)
    part = tl.load(po_ptr + base[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
    wsum = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(wsum == 0.0, 1.0, wsum)
    tl.store(o_ptr + (row // rep).to(tl.int64) * stride_on + (h * rep + row % rep) * stride_oh + dd,
             out.to(o_ptr.dtype.element_ty))
