"""The Triton-kernel path of the dense target's layers (kernels/attention.py, fused.py).

Per target layer it replaces q/k-norm + RoPE + cache write (cat, norms, mul, roll, addcmul, two
index_copy) by ``qkv_prep``, the masked SDPA over a bucketed key window by ``decode_attention``
over the live rows only, and ``silu(gate) * up`` by ``silu_mul``; the projections stay cuBLAS.
Used when ``models.layers.kernels_usable`` says so (CUDA by default, ``DDTREE_KERNELS=0`` turns it
off, supported shapes); otherwise the eager-op / SDPA path of target.py runs. The drafter's kernel
path is models/drafter/fast.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_server.kernels.attention import decode_attention
from ddtree_server.kernels.fused import qkv_prep, silu_mul


@dataclass
class FastBlock:
    """What the kernel path of one forward needs besides the layer inputs.

    start: 0-d long tensor on the device, cache rows before the new block (rows written are
    ``start + 0..n-1``; attention reads ``[0, start + n)``); mode: ``causal`` or ``tree``;
    block: bool ``[n, n]`` ancestor-or-self mask for ``tree``.
    """

    start: Tensor
    mode: str = "causal"
    block: Tensor | None = None


def rope(model, positions: Tensor, rows: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``TargetModel._rope`` by one lookup: cos, signed sin ``[n, 1, head_dim]`` (views) of positions
    ``[n]`` from a table of every position below ``max(max_position_embeddings, rows)``, built once
    per device and dtype by ``_rope`` itself (so the values are the ones it computes), instead of
    ~10 small kernels per forward. Positions must lie below that bound."""
    key = (positions.device, dtype)
    size = max(int(getattr(model.config, "max_position_embeddings", 0) or 0), rows)
    tab = model._rope_tables.get(key)
    if tab is None or tab.shape[0] < size:
        cos, sin = model._rope(torch.arange(size, device=positions.device), dtype)
        tab = model._rope_tables[key] = torch.cat((cos, sin), dim=1)  # [size, 2, head_dim]
    both = tab.index_select(0, positions)
    return both[:, :1], both[:, 1:]


def target_attention(attn, x: Tensor, cos: Tensor, sin: Tensor, cache, layer: int, fb: FastBlock) -> Tensor:
    """``Attention.forward`` on kernels: x ``[n, hidden]`` (normed) -> ``[n, heads * head_dim]``.
    cos / sin: ``[n, 1, head_dim]`` with rotate_half's sign in sin (TargetModel._rope)."""
    n, hq, hkv, d = x.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    qkv = attn.qkv_proj(x).view(n, hq + 2 * hkv, d)
    qw, kw, eps = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else (None, None, 0.0)
    kc, vc = cache.k[layer], cache.v[layer]
    q = qkv_prep(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], qw, kw, eps, cos, sin, kc, vc, fb.start)
    return decode_attention(q, kc, vc, fb.start, fb.mode, fb.block).view(n, hq * d)


def mlp_hidden(mlp, x: Tensor) -> Tensor:
    """``MLP.hidden`` on kernels: ``silu(gate(x)) * up(x)`` ``[n, intermediate]``."""
    gate, up = mlp.gate_up_proj(x).split(mlp.inter, dim=-1)
    return silu_mul(gate, up)


def start_tensor(s: int, device: torch.device) -> Tensor:
    """A 0-d long tensor holding s on device, written by a fill kernel (no host synchronisation)."""
    return torch.full((), s, dtype=torch.long, device=device)
