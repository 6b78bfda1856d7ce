"""Alternative address paths of the page pool for ``batch_split_kernel`` (attention_batch_kernels.py),
chosen by its constexpr ``VARIANT`` (kernels/attention_batch.py reads ``DDTREE_PAGED_VARIANT``).

Variant 0 (``row_offsets`` there) reads one page id per key row of a tile (``BLOCK_N`` loads of
which ``PAGE`` in a row are equal) and forms each row's offset in 64 bits; the K / V loads wait on
that read. The others read one id per page-sized sub-tile (``G = BLOCK_N // PAGE`` ids per tile),
multiply only those by the page stride (64-bit: a pool can pass 2**31 elements) and keep the
within-page part (``row * stride_kr + dd``) in 32 bits; with K and V of equal strides (``KV_SAME``,
every pool the engine makes) one offset block serves both loads:

* variant 2: a 3-D pointer block ``[G, PAGE, D]`` (page base + row in page + dd, contiguous runs of
  ``PAGE`` rows the compiler can see) loaded and reshaped (row-major, no reordering) to
  ``[BLOCK_N, D]``;
* variant 4, ``PRELOAD`` too: the ids of the split's whole key range ``[lo, hi)`` (at most ``PRE_IDS``) in one
  ``[PRE_IDS // G, G]`` load issued before the q load (their latency overlaps it); tile i takes
  row i of that block in registers (a select and a sum: exact), so no tile's K / V load waits on a
  page-table read of its own. Longer ranges read each tile's ``G`` ids in the loop.

(Variants 1 and 3, the same with per-row offsets and 2-D loads, were 1.44x and 1.49x the slot pool
on one H200 and are gone: docs/benchmarks/h200-2026-12-04-rings/.)

The loaded tiles are the very elements variant 0 loads (zeros past ``hi``), in the same order, so
the tiles, splits and arithmetic and hence the bits are unchanged (tests/server/test_kernels_paged.py)."""

import triton
import triton.language as tl


@triton.jit
def split_page_ids(lo, hi, r, pages_ptr, stride_pr, PAGE: tl.constexpr, G: tl.constexpr, PRE_IDS: tl.constexpr):
    """``(ids [PRE_IDS // G, G], fits)``: the page ids of the tiles of ``[lo, hi)`` (lo a multiple of
    a tile) when the range has at most ``PRE_IDS // G`` tiles (``fits``), else nothing read;
    sub-tiles at or past ``hi`` read page 0."""
    TC: tl.constexpr = PRE_IDS // G
    fits = hi - lo <= TC * G * PAGE
    p = lo // PAGE + tl.arange(0, TC)[:, None] * G + tl.arange(0, G)[None, :]
    ids = tl.load(pages_ptr + r * stride_pr + p, mask=p * PAGE < tl.where(fits, hi, 0), other=0)
    return ids, fits


@triton.jit
def tile_page_ids(t, lo, hi, r, pages_ptr, stride_pr, pre_ids, fits, PAGE: tl.constexpr, G: tl.constexpr,
                  PRE_IDS: tl.constexpr, PRELOAD: tl.constexpr):
    """Page ids ``[G]`` of the sub-tiles of the tile at key row ``t`` (page 0 at or past ``hi``)."""
    if PRELOAD:
        if fits:
            i = (t - lo) // (G * PAGE)
            ids = tl.sum(tl.where(tl.arange(0, PRE_IDS // G)[:, None] == i, pre_ids, 0), 0)
        else:
            p = t // PAGE + tl.arange(0, G)
            ids = tl.load(pages_ptr + r * stride_pr + p, mask=p * PAGE < hi, other=0)
    else:
        p = t // PAGE + tl.arange(0, G)
        ids = tl.load(pages_ptr + r * stride_pr + p, mask=p * PAGE < hi, other=0)
    return ids


@triton.jit
def _load_rows(base, ids, t, hi, dd, stride_s, stride_r, MASKED: tl.constexpr, PAGE: tl.constexpr,
               G: tl.constexpr, D: tl.constexpr):
    """The ``[G * PAGE, D]`` tile of pages ``ids`` (rows from ``t``; rows at or past ``hi`` zero
    when ``MASKED``) of one pool whose head base pointer is ``base``."""
    pb = base + ids.to(tl.int64) * stride_s                 # [G] page bases (64-bit)
    win = tl.arange(0, PAGE) * stride_r                      # [PAGE] within-page rows (32-bit)
    ptr = pb[:, None, None] + (win[:, None] + dd[None, :])[None, :, :]
    if MASKED:
        j = t + tl.arange(0, G)[:, None] * PAGE + tl.arange(0, PAGE)[None, :]
        x = tl.load(ptr, mask=(j < hi)[:, :, None], other=0.0)
    else:
        x = tl.load(ptr)
    return tl.reshape(x, [G * PAGE, D])


@triton.jit
def paged_kv(kb, vb, ids, t, hi, dd, stride_ks, stride_kr, stride_vs, stride_vr, MASKED: tl.constexpr,
             PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, KV_SAME: tl.constexpr):
    """K and V tiles ``[G * PAGE, D]`` at key row ``t`` through sub-tile page ids ``ids``."""
    k = _load_rows(kb, ids, t, hi, dd, stride_ks, stride_kr, MASKED, PAGE, G, D)
    if KV_SAME:   # equal strides: one offset computation (CSE) for both
        v = _load_rows(vb, ids, t, hi, dd, stride_ks, stride_kr, MASKED, PAGE, G, D)
    else:
        v = _load_rows(vb, ids, t, hi, dd, stride_vs, stride_vr, MASKED, PAGE, G, D)
    return k, v
