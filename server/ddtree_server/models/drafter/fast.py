"""The Triton-kernel path of the drafter's layers (GraphedDrafter; kernels/attention.py, fused.py).

Per draft layer: q/k-norm + RoPE + cache write by ``qkv_prep``, attention over the live rows by
``decode_attention`` (full, causal or sliding window as the layer's kind says), ``silu(gate) * up``
by ``silu_mul``; q|k|v and gate|up run as one GEMM each (``fuse_drafter``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels.attention import decode_attention
from ddtree_server.kernels.fused import qkv_prep, silu_mul
from ddtree_server.models.layers import kernels_usable, linear_add


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
    x = linear_add(x, out.view(bs, hq * d), attn.o_proj)
    xn = layer.post_attention_layernorm(x)
    if fused is not None:
        gate, up = torch.nn.functional.linear(xn, fused[1]).split(mlp.intermediate_size, dim=-1)
    else:
        gate, up = mlp.gate_proj(xn), mlp.up_proj(xn)
    return linear_add(x, silu_mul(gate, up), mlp.down_proj)


def drafter_usable(drafter) -> bool:
    """The drafter's layers can take the kernel path (silu MLP, supported head size)."""
    cfg = drafter.config
    return cfg.hidden_act in ("silu", "swish") and kernels_usable(cfg.head_dim, drafter.fc.weight)
