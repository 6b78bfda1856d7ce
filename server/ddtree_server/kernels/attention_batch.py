"""Split-K decode / verify attention of several requests in one launch (Triton), over a slot pool.

The request axis of ``kernels/attention.py``: query rows of all requests flattened ``[N, hq, d]``
(request r owns rows ``[qo[r], qo[r + 1])``), the cache one layer of the slot pool
``[slots, kv_heads, rows, d]`` (request r reads slot ``slot[r]``), the live lengths ``start[r]``
read on the device. Visibility per request as the one-request kernel (``causal``, or ``tree`` with
request r's ancestor-or-self mask ``block[r, :n_r, :n_r]``). Launch settings come from the same
``plan`` (the model's shape), so every row gets the key splits and tiles it gets alone: a
request's attention rows are bitwise equal alone and in any batch (tests/server/test_kernels_batch.py).

With ``pages`` the cache is a page pool ``[num_pages, kv_heads, page_size, d]`` and request r's rows
are found through its page-table row ``pages[r]`` (row j: page ``pages[r, j // page_size]``, row
``j % page_size``); the plan is the one of a slot of ``pages.shape[1] * page_size`` rows, so the
rows are bitwise those of the slot pool (engine/batch/pages.py keeps the tables). The page pool's
address path (kernels/attention_paged_kernels.py, the same bits in every variant) is chosen by
``default_variant`` from a sweep on one H200 (bench/paged_attention.py ``--variants``); for
experiments ``DDTREE_PAGED_VARIANT`` (0: one page-table read per key row; 2, 4: sub-tile page ids),
``DDTREE_PAGED_STAGES`` (pipeline stages of the paged launch) and ``DDTREE_PAGED_PRELOAD`` (the
page ids variant 4 reads up front), read at each call.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from ddtree_server.kernels.attention import DEFAULT, LOG2E, AttnConfig, plan, supported
from ddtree_server.kernels.runtime import HAVE_TRITON

_MODES = {"causal": 0, "tree": 1, "block": 2}

if HAVE_TRITON:
    import triton

    from ddtree_server.kernels.attention_batch_kernels import (
        batch_merge_kernel,
        batch_split_kernel,
    )


PAGED_VARIANTS = (0, 2, 4)
BIG_SMEM = 160 << 10   # shared memory per block for the paged launch's third pipeline stage


@functools.lru_cache(maxsize=None)
def _smem(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0))


def default_variant(head_dim: int, device, stages: int, m_tiles: int = 1, tree: bool = False,
                    elem: int = 2) -> tuple[int, int]:
    """(variant, num_stages) of a paged launch by default, from the sweeps on one H200
    (docs/benchmarks/h200-2026-12-04-rings/): head dims up to 128 with one row block of causal or
    block rows (decode steps, chains, draft blocks) take variant 4 (a 3-D tile from sub-tile page
    ids read up front) at 3 stages where the shared memory holds them (0.95-1.03x the slot pool
    against variant 0's 1.08-1.13x); tree masks and several row blocks keep variant 0, since
    variant 4 made the 8B shape's batch-64 DDTree round 1.16x the slot layout's against 1.04x
    (the cases measured; prompt chunks and lone small trees were not); larger head dims variant 2
    (the 3-D tile) at the launch's stages (1.03-1.10x against 1.02-1.12x). Three stages of
    fp32 tiles (``elem`` 4 bytes) would need more shared memory than some GPUs of 160 KiB have:
    fp32 takes variant 2 at the launch's stages too."""
    if head_dim > 128:
        return 2, stages
    if m_tiles > 1 or tree:
        return 0, stages
    if elem <= 2 and torch.device(device).type == "cuda" and _smem(torch.device(device)) >= BIG_SMEM:
        return 4, 3
    return 2, stages


def paged_settings(page: int, block_n: int, stages: int, head_dim: int = 128, device="cpu",
                   m_tiles: int = 1, tree: bool = False, elem: int = 2) -> tuple[int, int, int]:
    """(variant, num_stages, preloaded ids) of a paged launch: ``default_variant``, or the
    environment's (``DDTREE_PAGED_VARIANT`` / ``_STAGES`` / ``_PRELOAD``: the sweep's knobs); variants
    past 0 need pages of a power of two that divide the key tile (else variant 0)."""
    variant, stages = default_variant(head_dim, device, stages, m_tiles, tree, elem)
    variant = int(os.environ.get("DDTREE_PAGED_VARIANT", "") or variant)
    if variant not in PAGED_VARIANTS:
        raise ValueError(f"DDTREE_PAGED_VARIANT {variant}: one of {PAGED_VARIANTS}")
    if variant and (page & (page - 1) or block_n % page):
        variant = 0
    pre = int(os.environ.get("DDTREE_PAGED_PRELOAD", "64") or 64) if variant == 4 else 64
    pre = max(pre, block_n // page if variant else 1)
    if pre & (pre - 1):
        raise ValueError(f"DDTREE_PAGED_PRELOAD {pre}: a power of two")
    return variant, int(os.environ.get("DDTREE_PAGED_STAGES", "0") or 0) or stages, pre


def batch_attention(q: Tensor, k: Tensor, v: Tensor, start: Tensor, qo: Tensor, slot: Tensor, n_max: int,
                    mode: str = "causal", block: Tensor | None = None, scale: float | None = None,
                    config: AttnConfig = DEFAULT, pages: Tensor | None = None, window: int | None = None) -> Tensor:
    """Attention of b requests' new rows over their slots.

    Args:
        q: ``[N, hq, d]`` queries of all requests (last axis contiguous).
        k, v: ``[slots, hkv, rows, d]`` one layer of the slot pool; request r's new K/V already at
            rows ``[start[r], start[r] + n_r)`` of slot ``slot[r]``. With ``pages``: one layer of
            the page pool ``[num_pages, hkv, page_size, d]`` (``slot`` is then not read).
        start, qo, slot: int tensors on q's device, ``[b]``, ``[b + 1]`` (row offsets), ``[b]``.
        n_max: the largest n_r (sizes the grid); mode: ``causal`` | ``tree`` | ``block`` (every
            new row sees all new rows: a DFlash draft block); block: bool / uint8
            ``[b, n_max, n_max]`` ancestor-or-self masks (tree).
        window: a sliding window W (keys W or more positions before a query hidden, and in
            ``block`` mode after it), None for none.
        pages: int32 ``[b, max_pages]`` page-table rows of the requests (batch order), or None.
    Returns ``[N, hq, d]`` in q's dtype. Raises ValueError for bad shapes / dtypes, RuntimeError
    without Triton.
    """
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or q.shape[2] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"need q [N, hq, d] and k / v [slots, hkv, rows, d], got {tuple(q.shape)}, {tuple(k.shape)}")
    n_tot, hq, d = q.shape
    hkv, rows = k.shape[1], k.shape[2]
    b = start.shape[0]
    page = rows if pages is not None else 1   # constexpr: 1 for the slot pool (no specialisation by rows)
    if pages is not None:
        if pages.dim() != 2 or pages.shape[0] != b or pages.stride(1) != 1 or pages.dtype != torch.int32:
            raise ValueError(f"pages must be int32 [b, max_pages] with a contiguous last axis, got {tuple(pages.shape)}")
        rows = pages.shape[1] * page   # the capacity of a request: its plan is a slot's of that size
    if not supported(d, q.dtype) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"unsupported head_dim {d} or dtypes {q.dtype}/{k.dtype}/{v.dtype}")
    if q.stride(2) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or qo.shape[0] != b + 1 or slot.shape[0] != b:
        raise ValueError("contiguous last axes and start [b], qo [b + 1], slot [b] are needed")
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r}: use causal, tree or block")
    if window is not None and (mode == "tree" or window < 1):
        raise ValueError(f"window {window!r}: a positive window of causal or block attention")
    if mode == "tree":
        if block is None or tuple(block.shape) != (b, n_max, n_max) or block.stride(2) != 1:
            raise ValueError(f"mode 'tree' needs block masks [{b}, {n_max}, {n_max}]")
        block = block.view(torch.uint8) if block.dtype == torch.bool else block
    rep = hq // hkv
    block_m, block_n, splits = plan(n_max, rep, hkv, d, rows, q.device, config)
    m_tiles = math.ceil(n_max * rep / block_m)
    m_pad = m_tiles * block_m
    out = torch.empty((n_tot, hq, d), dtype=q.dtype, device=q.device)
    po = pl = out
    if splits > 1:
        po = torch.empty((splits, b * hkv, m_pad, d), dtype=torch.float32, device=q.device)
        pl = torch.empty((splits, b * hkv, m_pad), dtype=torch.float32, device=q.device)
    mask = block if mode == "tree" else start
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    scale_log2 = (scale if scale is not None else d ** -0.5) * LOG2E
    table = pages if pages is not None else slot
    variant, stages, pre = (paged_settings(page, block_n, config.num_stages, d, q.device, m_tiles, mode == "tree",
                                           q.element_size())
                            if pages is not None
                            else (0, config.num_stages, 64))
    batch_split_kernel[(splits, b * hkv, m_tiles)](
        q, k, v, start, qo, slot, table, mask, out, po, pl, hkv, rep, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), table.stride(0),
        mask.stride(0) if mode == "tree" else 0, mask.stride(1) if mode == "tree" else 0,
        out.stride(0), out.stride(1), m_pad, scale_log2, window or 0, MODE=_MODES[mode], SPLITS=splits,
        BLOCK_M=block_m, BLOCK_N=block_n, D=d, PREC=prec, PAGED=pages is not None, PAGE=page, WINDOWED=window is not None,
        VARIANT=variant, KV_SAME=variant > 0 and k.stride() == v.stride(), PRE_IDS=pre,
        num_warps=config.num_warps, num_stages=stages)
    if splits > 1:
        batch_merge_kernel[(n_max * rep, b * hkv)](po, pl, out, start, qo, hkv, rep, out.stride(0), out.stride(1),
                                                   m_pad, SPLITS=splits, SP2=triton.next_power_of_2(splits),
                                                   BLOCK_N=block_n, D=d, num_warps=4)
    return out
