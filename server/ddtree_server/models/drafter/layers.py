"""Building blocks of the DFlash drafter (docs/ddtree.md §1.5): attention with queries only for the
block and keys/values for context + block, and the pre-norm decoder layer (RMSNorm: models/layers.py).

Parameter names equal the z-lab checkpoint keys below `layers.{i}.` (docs/ddtree.md §1.3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.layers import RMSNorm, check_silu


def hf_config(cfg: DrafterConfig):
    """The drafter's sizes as a transformers ``Qwen3Config`` (only for RoPE types other than the
    default, whose inverse frequencies transformers computes; its import costs ~2 s)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=dict(cfg.rope_parameters),
        max_position_embeddings=cfg.max_position_embeddings, attention_bias=cfg.attention_bias)


def rotate_half(x: Tensor) -> Tensor:
    """``[-x2, x1]`` of the two halves of the last axis (the half-split RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SwiGLU(nn.Module):
    """Qwen3's MLP, ``down(silu(gate(x)) * up(x))``, with the checkpoint's separate gate / up names."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        check_silu(act)
        self.intermediate_size = inter
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, heads, T, hd]; cos/sin: [B, T, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """q/k/v/o projections with per-head q/k RMSNorm (Qwen3 style); queries only for the block."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps)

    def q(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x: [B, T, H] (already input-normed) -> roped queries [B, heads, T, hd]."""
        b, t, _ = x.shape
        return _rope(self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2), cos, sin)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x: [B, T, H] -> roped keys and values, each [B, kv_heads, T, hd]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q: [B, heads, Tq, hd]; k/v: [B, kv_heads, Tk, hd]; mask: bool [B, 1, Tq, Tk] (True = see)
        or None (everything visible, non-causal). Returns [B, Tq, H]."""
        rep = self.n_heads // self.n_kv
        gqa = rep > 1 and mask is None  # fused GQA kernels take no arbitrary mask: repeat K/V then
        if rep > 1 and not gqa:  # = repeat_interleave(rep, dim=1), as views + one copy (graph-safe)
            b, h, t, d = k.shape
            k = k[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)
            v = v[:, :, None].expand(b, h, rep, t, d).reshape(b, h * rep, t, d)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=self.head_dim ** -0.5,
                                           enable_gqa=gqa)
        b, _, t, _ = a.shape
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer; the context features join the keys/values without a per-layer norm."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def finish(self, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual add of the attention output, then the MLP sub-block."""
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))
