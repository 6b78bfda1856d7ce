"""Decode / tree-verify attention over the static KV cache, split over the key length (Triton).

Batch-1 decoding asks attention for a few query rows against a long cached prefix: one query
token (or a 16-80 node tree) per KV head. A fused attention kernel that gives each program a
block of query rows launches only ``kv_heads`` programs there, each streaming every key alone.
Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023) splits the keys
over many programs instead and merges their partial softmaxes; this module does that:

* ``split_kernel``: program (row block, kv head, split) runs the online softmax (fp32, Milakov &
  Gimelshein 2018) over its share of the keys ``[0, start + n)`` of ONE KV head; its rows are the
  ``rep`` query heads of that KV head for each query token (GQA: each K/V tile is read once for
  all of them). The cache ``[kv_heads, rows, head_dim]`` is read in place and only up to the live
  length, which comes from the device scalar ``start`` (so one CUDA graph serves every length).
* ``merge_kernel``: combines the splits' (output, log-sum-exp) pairs; skipped with one split.
  Opt-in (``AttnConfig.fused_merge``): no second launch; the split programs of one (KV head, row
  block) count themselves on a device counter (acq_rel atomic) and the last one merges and resets
  it, the "last block" reduction pattern of split-K / stream-K GEMMs.

Visibility of key ``j`` for query token ``i`` (``s = start``): keys ``j < s`` always; inside the
new block ``[s, s + n)``: ``causal`` j - s <= i, ``tree`` ``block[i, j - s]`` (ancestor-or-self
mask ``[n, n]``), ``full`` every key (the DFlash drafter's non-causal block). A ``window`` W > 0
(sliding-window draft layers, z-lab ``dflash/model.py``) also hides keys with
``(s + i) - j >= W`` and, for ``full``, ``j - (s + i) >= W``.
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
                  block: Tensor | None = None, scale: float | None = None, window: int = 0) -> Tensor:
    """q ``[n, hq, d]``, k / v ``[hkv, rows, d]`` (one layer of the cache) -> ``[n, hq, d]`` in q's
    dtype. Keys ``[0, start + n)`` are read; visibility as in the module docstring."""
    n, hq, d = q.shape
    hkv, length = k.shape[0], start + n
    vis = torch.ones((n, length), dtype=torch.bool, device=q.device)
    if mode == "causal":
        vis[:, start:] = torch.ones((n, n), dtype=torch.bool, device=q.device).tril_()
    elif mode == "tree":
        vis[:, start:] = block.bool()
    if window:
        dist = (start + torch.arange(n, device=q.device))[:, None] - torch.arange(length, device=q.device)[None, :]
        vis &= (dist < window) & ((-dist < window) if mode == "full" else True)
    kk = k[:, :length].float().repeat_interleave(hq // hkv, 0)
    vv = v[:, :length].float().repeat_interleave(hq // hkv, 0)
    scores = torch.einsum("nhd,hld->hnl", q.float(), kk) * (scale if scale is not None else d ** -0.5)
    p = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    return torch.einsum("hnl,hld->nhd", p, vv).to(q.dtype)


@dataclass(frozen=True)
class AttnConfig:
    """Launch settings: query-row tile (0: by the number of rows), key tile, warps, pipeline
    stages, programs aimed at per SM, split cap."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: float = 2.0
    max_splits: int = 64
    fused_merge: bool = False

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}c{self.ctas_per_sm:g}"
                + "f" * self.fused_merge)


DEFAULT = AttnConfig()


LONG_BLOCK = 512  # blocks of more query tokens (prompts) split their keys only while programs are few
INT32_MAX = 2 ** 31 - 1
GRID_YZ_MAX = 65535  # CUDA's limit on grid axes 1 and 2 (axis 0: 2**31 - 1)


def plan(n: int, rep: int, kv_heads: int, head_dim: int, rows: int, device, cfg: AttnConfig = DEFAULT
         ) -> tuple[int, int, int]:
    """(block_m, block_n, splits) for n query tokens: row blocks of the ``n * rep`` rows of one
    KV head, and enough key splits that the programs of a one-token forward fill ``ctas_per_sm``
    per SM. For blocks of up to ``LONG_BLOCK`` tokens (decode steps, chains, trees: every CUDA-graph
    bucket) the split count depends on the model's shape only (not on n or the live length), so
    a CUDA graph can hold it and every forward splits a row's keys alike. A longer block (a
    prompt) has row blocks enough to fill the GPU: it splits only up to that many programs, so
    its fp32 partials stay small (one split per program at 16k tokens of Qwen3-8B would take
    8.9 GB; docs/architecture.md, "Long contexts")."""
    # one row-block size for every n (block_m 0: the smallest block that holds n * rep rows): the
    # same MMA shape then computes a row's scores in a one-token step and in a verify
    m_rows = n * rep
    block_m = cfg.block_m or (16 if m_rows <= 16 else 32 if m_rows <= 32 else 64)
    block_n = cfg.block_n
    if head_dim >= 256:
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    # the split count ignores the row blocks (it is the one-token forward's): one-token steps and
    # chain / tree verifies then cut the keys at the same places (see per_split), so a chain
    # verify gives the bits of plain decoding (bf16 included)
    programs = cfg.ctas_per_sm * sm_count(device)
    splits = max(1, min(math.ceil(programs / kv_heads), cfg.max_splits, math.ceil(rows / block_n)))
    if n > LONG_BLOCK:
        splits = max(1, min(splits, math.ceil(programs / (kv_heads * math.ceil(m_rows / block_m)))))
    return block_m, block_n, splits


def launch_limits(n: int, hq: int, kv_heads: int, head_dim: int, rows: int, device,
                  cfg: AttnConfig = DEFAULT, q_row_stride: int | None = None,
                  kv_row_stride: int | None = None) -> dict[str, int]:
    """The largest grid extents and 32-bit element offsets of one ``decode_attention`` call
    (n query tokens over a cache of ``rows`` rows), for ``check_limits`` and the tests that
    check every shape up to 262,144 tokens. Offsets the kernels compute in 64 bits (token rows of
    q / out, the partials, the head of k / v) are not listed: only what stays 32-bit."""
    rep = hq // kv_heads
    block_m, block_n, splits = plan(n, rep, kv_heads, head_dim, rows, device, cfg)
    m_tiles = math.ceil(n * rep / block_m)
    kv_row_stride = kv_row_stride or head_dim
    return {"grid_axis0": m_tiles, "grid_axis1": kv_heads, "grid_axis2": splits,
            "merge_axis0": n * rep, "merge_axis1": kv_heads,
            # key row j of one head: j * row stride (j < rows); the last tile may reach block_n past
            "kv_offset": (rows + block_n) * kv_row_stride + head_dim,
            "partial_bytes": 0 if splits == 1 else splits * kv_heads * m_tiles * block_m * (head_dim + 1) * 4,
            "splits": splits, "q_row_stride": q_row_stride or hq * head_dim}


def check_limits(lim: dict[str, int]) -> None:
    """Raise ValueError where a launch would pass CUDA's grid limits or a 32-bit offset (a wrong
    answer or an illegal memory access otherwise)."""
    for key, cap in (("grid_axis0", INT32_MAX), ("grid_axis1", GRID_YZ_MAX), ("grid_axis2", GRID_YZ_MAX),
                     ("merge_axis0", INT32_MAX), ("merge_axis1", GRID_YZ_MAX), ("kv_offset", INT32_MAX)):
        if lim[key] > cap:
            raise ValueError(f"decode_attention: {key} {lim[key]} exceeds {cap}")


if HAVE_TRITON:
    import triton

    from ddtree_server.kernels.attention_kernels import merge_kernel, split_kernel


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
                     config: AttnConfig = DEFAULT, window: int = 0) -> Tensor:
    """Attention of ``n`` new query tokens over the cache, as ``attention_ref`` computes it.

    Args:
        q: ``[n, hq, d]`` queries (last axis contiguous; other strides free).
        k, v: ``[hkv, rows, d]`` one layer of the static cache (hq a multiple of hkv), holding the
            new block's keys / values at rows ``[start, start + n)`` already.
        start: 0-d integer tensor on q's device: cached rows before the block (read on device).
        mode: ``causal`` | ``tree`` | ``full`` (module docstring); ``block``: bool / uint8
            ``[n, n]`` ancestor-or-self mask for ``tree``.
        scale: softmax scale (default ``d ** -0.5``); out: optional ``[n, hq, d]`` result buffer.
        window: sliding window W (0 = none; module docstring).
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
    if window < 0 or (window and mode == "tree"):
        raise ValueError(f"window {window}: must be >= 0, and 0 with a tree mask")
    if mode == "tree":
        if block is None or tuple(block.shape) != (n, n) or block.stride(1) != 1:
            raise ValueError(f"mode 'tree' needs a row-major block mask [{n}, {n}]")
        block = block.view(torch.uint8) if block.dtype == torch.bool else block
    rep = hq // hkv
    block_m, block_n, splits = plan(n, rep, hkv, d, rows, q.device, config)
    check_limits(launch_limits(n, hq, hkv, d, rows, q.device, config, q.stride(0),
                               max(k.stride(1), v.stride(1))))
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
    split_kernel[(m_tiles, hkv, splits)](
        q, k, v, start, mask, out, po, pl, cnt, n, rep, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), mask.stride(0) if mode == "tree" else 0, out.stride(0), out.stride(1),
        m_pad, scale_log2, window, MODE=MODES[mode], SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        PREC=prec, FUSED=fused, WINDOWED=window > 0, num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1 and not fused:
        merge_kernel[(n * rep, hkv)](po, pl, out, start, n, rep, out.stride(0), out.stride(1), m_pad,
                                      SPLITS=splits, SP2=triton.next_power_of_2(splits), BLOCK_N=block_n, D=d,
                                      num_warps=4)
    return out
