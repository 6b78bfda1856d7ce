"""The Triton-kernel path of the target's and the drafter's layers (kernels/attention.py, fused.py).

Per target layer it replaces q/k-norm + RoPE + cache write (cat, norms, mul, roll, addcmul, two
index_copy) by ``qkv_prep``, the masked SDPA over a bucketed key window by ``decode_attention``
over the live rows only, and ``silu(gate) * up`` by ``silu_mul``; the projections stay cuBLAS.
Used when ``kernels.runtime.enabled`` says so (CUDA by default, ``DDTREE_KERNELS=0`` turns it off)
and the shapes are supported; otherwise the eager-op / SDPA path of target.py runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_server.kernels import runtime
from ddtree_server.kernels.attention import decode_attention, supported
from ddtree_server.kernels.fused import qkv_prep, rms_norm, silu_mul  # noqa: F401 (rms_norm: target.RMSNorm)


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


def norm_usable(x: Tensor) -> bool:
    """RMSNorm of x takes the Triton kernel (kernel path on, no autograd through it)."""
    return (runtime.enabled(x.device) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not (x.requires_grad and torch.is_grad_enabled()))


def usable(head_dim: int, weight: Tensor) -> bool:
    """True when forwards with this head size and weight dtype / device take the kernel path."""
    return runtime.enabled(weight.device) and supported(head_dim, weight.dtype)


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


# ---------------------------------------------------------------- drafter (GraphedDrafter)
def _addmm(residual: Tensor, x: Tensor, linear) -> Tensor:
    """``residual + linear(x)`` in one GEMM when the layer has no bias."""
    if linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    return residual + linear(x)


def fuse_drafter(drafter) -> list[tuple[Tensor, Tensor] | None]:
    """Per draft layer: the q|k|v weight ``[(hq + 2*hkv)*d, hidden]`` and the gate|up weight
    ``[2*inter, hidden]`` as single tensors, one GEMM each instead of three and two. The layer's own
    q/k/v and gate/up weights are re-pointed at row slices of them (same values, no second copy),
    so the module, its state dict and the eager path see what they saw. None for a layer with
    biases (kept unfused)."""
    out: list[tuple[Tensor, Tensor] | None] = []
    with torch.inference_mode(False), torch.no_grad():  # normal tensors: the parameters keep them
        for layer in drafter.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
            if any(lin.bias is not None for group in parts for lin in group):
                out.append(None)
                continue
            fused = []
            for group in parts:
                whole = torch.cat([lin.weight for lin in group])
                row = 0
                for lin in group:
                    rows = lin.weight.shape[0]
                    lin.weight.data = whole[row:row + rows]
                    row += rows
                fused.append(whole)
            out.append((fused[0], fused[1]))
    return out


def drafter_context_kv(attn, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       row0: Tensor, fused: tuple[Tensor, Tensor] | None = None) -> None:
    """Context K/V of one draft layer: h ``[n, hidden]`` (projected features), cos / sin
    ``[n, head_dim]`` (plain sin); written to cache rows ``row0 + 0..n-1``. ``fused``: the layer's
    ``fuse_drafter`` weights (one GEMM for k|v)."""
    n, hq, hkv, d = h.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    if fused is not None:
        kv = torch.nn.functional.linear(h, fused[0][hq * d:]).view(n, 2 * hkv, d)
        k, v = kv[:, :hkv], kv[:, hkv:]
    else:
        k, v = attn.k_proj(h).view(n, hkv, d), attn.v_proj(h).view(n, hkv, d)
    qkv_prep(None, k, v, attn.q_norm.weight, attn.k_norm.weight, attn.k_norm.eps, cos, sin, k_cache, v_cache,
             row0, signed_sin=False)


def drafter_layer(layer, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  start: Tensor, fused: tuple[Tensor, Tensor] | None = None,
                  kind: tuple[bool, int | None] = (False, None)) -> Tensor:
    """One DFlash layer over the block x ``[bs, hidden]`` at rows ``start + 0..bs-1``: its K/V go
    to the cache; its queries see the cached rows and the block as the layer's ``kind`` =
    (causal, sliding window) says (``DrafterConfig.attention_kind``; (False, None): everything)."""
    attn, mlp = layer.self_attn, layer.mlp
    bs, hq, hkv, d = x.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    xn = layer.input_layernorm(x)
    if fused is not None:
        qkv = torch.nn.functional.linear(xn, fused[0]).view(bs, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    else:
        q, k, v = (attn.q_proj(xn).view(bs, hq, d), attn.k_proj(xn).view(bs, hkv, d),
                   attn.v_proj(xn).view(bs, hkv, d))
    q = qkv_prep(q, k, v, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos, sin, k_cache, v_cache,
                 start, signed_sin=False)
    causal, window = kind
    out = decode_attention(q, k_cache, v_cache, start, "causal" if causal else "full", scale=d ** -0.5,
                           window=window or 0)
    x = _addmm(x, out.view(bs, hq * d), attn.o_proj)
    xn = layer.post_attention_layernorm(x)
    if fused is not None:
        gate, up = torch.nn.functional.linear(xn, fused[1]).split(mlp.intermediate_size, dim=-1)
    else:
        gate, up = mlp.gate_proj(xn), mlp.up_proj(xn)
    return _addmm(x, silu_mul(gate, up), mlp.down_proj)


def drafter_usable(drafter) -> bool:
    """The drafter's layers can take the kernel path (silu MLP, supported head size)."""
    cfg = drafter.config
    return cfg.hidden_act in ("silu", "swish") and usable(cfg.head_dim, drafter.fc.weight)


def start_tensor(s: int, device: torch.device) -> Tensor:
    """A 0-d long tensor holding s on device, written by a fill kernel (no host synchronisation)."""
    return torch.full((), s, dtype=torch.long, device=device)
