"""Skinny GEMM ``y = x @ w.T`` for few rows (batch-1 decode and tree verify: M = 1..128) in Triton.

At batch 1 a linear layer reads its whole weight ``[N, K]`` for a handful of rows, so its speed is
the weight read: the kernel gives each program a ``BLOCK_N x K/split_k`` strip of the weight,
streams it in ``BLOCK_K`` chunks and accumulates in fp32; ``split_k > 1`` splits K over more
programs (more loads in flight for short, wide matrices) and sums the fp32 partials afterwards.
M = 1 uses a multiply-and-reduce (no tensor cores needed); BLOCK_M >= 16 uses ``tl.dot``.
Reference: ``skinny_matmul_ref`` (torch). The Triton kernel is used only where Triton is installed;
on CPU it runs under ``TRITON_INTERPRET=1`` (tests; fp32 / fp16 there, bf16 needs a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the server runs without Triton; only the probe / kernels tests need it
    HAVE_TRITON = False


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes: rows per program (1 or >= 16), output columns, K chunk, K splits, warps."""

    block_m: int = 1
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}"


# small search spaces for the probe (M = 1, then M >= 16)
CONFIGS_M1 = (GemvConfig(1, 16, 512, 1), GemvConfig(1, 32, 256, 1), GemvConfig(1, 64, 128, 1),
              GemvConfig(1, 16, 256, 4), GemvConfig(1, 32, 512, 2), GemvConfig(1, 64, 256, 2, 8))
CONFIGS_MN = (GemvConfig(16, 64, 128, 1), GemvConfig(16, 32, 256, 2), GemvConfig(16, 64, 64, 4),
              GemvConfig(32, 64, 128, 1), GemvConfig(16, 128, 64, 1, 8), GemvConfig(16, 64, 128, 2))


def skinny_matmul_ref(x: Tensor, w: Tensor) -> Tensor:
    """x ``[M, K]``, w ``[N, K]`` -> ``[M, N]`` in x's dtype, accumulated in fp32."""
    return (x.float() @ w.float().t()).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys, k_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = pid_k * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            if USE_DOT:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        out = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def skinny_matmul(x: Tensor, w: Tensor, config: GemvConfig | None = None) -> Tensor:
    """``x @ w.T`` with the Triton kernel: x ``[M, K]``, w ``[N, K]`` (same dtype and device,
    row-major) -> ``[M, N]`` in x's dtype.

    Raises RuntimeError without Triton, ValueError for mismatched shapes / dtypes or a config
    whose block_m is neither 1 nor >= 16.
    """
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError("x and w must share dtype and device")
    m, k = x.shape
    n = w.shape[0]
    cfg = config or (CONFIGS_M1[1] if m == 1 else CONFIGS_MN[0])
    if cfg.block_m != 1 and cfg.block_m < 16:
        raise ValueError(f"block_m must be 1 or >= 16, got {cfg.block_m}")
    x, w = x.contiguous(), w.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))
    if cfg.split_k == 1:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        stride_ys = 0
    else:
        y = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        stride_ys = y.stride(0)
    _skinny_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(-2), stride_ys, k_per_split,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         USE_DOT=cfg.block_m >= 16, num_warps=cfg.num_warps)
    return y if cfg.split_k == 1 else y.sum(0).to(x.dtype)
