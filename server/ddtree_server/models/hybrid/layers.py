"""Qwen3.5 decoder pieces besides GDN: zero-centred RMSNorm, gated full attention, decoder layer.

Sources: transformers ``models/qwen3_5/modeling_qwen3_5.py`` (``Qwen3_5RMSNorm``,
``Qwen3_5Attention``, ``Qwen3_5DecoderLayer``). Differences from the Llama family that matter:
* RMSNorm weights are zero-centred: ``norm(x) * (1 + w)`` in fp32 (final norm, layer norms and q/k norms);
* the q projection carries an output gate per head: ``q_proj(x).view(n, H, 2*hd)`` -> (q, gate);
  the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``;
* RoPE on the first ``rotary_dim = head_dim * partial_rotary_factor`` channels only (for text,
  Qwen3.5's multimodal RoPE reduces to this plain 1-D RoPE: all three position streams are equal).
Attention reuses the dense target's KV-cache conventions (rows / kv_len for CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.kernels.attention import decode_attention
from ddtree_server.models.hybrid.config import GDN
from ddtree_server.models.hybrid.gdn import GatedDeltaNet
from ddtree_server.models.layers import MLP, apply_rope, kernels_usable, linear_add


class ZeroCenteredRMSNorm(nn.Module):
    """``rms_norm(x) * (1 + weight)`` computed in fp32, cast back (transformers ``Qwen3_5RMSNorm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


class GatedAttention(nn.Module):
    """GQA attention with q/k norms, partial RoPE and a sigmoid output gate; fused q|k|v projection
    (``qkv_proj`` = checkpoint ``q_proj`` (q and gate) | ``k_proj`` | ``v_proj``)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rot = cfg.rotary_dim
        hd, bias = self.head_dim, cfg.attention_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, (2 * self.n_heads + 2 * self.n_kv) * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, cfg.rms_norm_eps)

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x ``[n, hidden]`` (normed) -> q ``[n, heads, d]`` and k ``[n, kv_heads, d]`` (normed,
        rotated), v ``[n, kv_heads, d]`` and the output gate ``[n, heads * d]`` (pre-sigmoid)."""
        n, hq, hkv, hd = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qg, k, v = self.qkv_proj(x).split((2 * hq * hd, hkv * hd, hkv * hd), dim=-1)
        qg = qg.view(n, hq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, hq * hd)
        qk = torch.cat((self.q_norm(q), self.k_norm(k.view(n, hkv, hd))), dim=1)
        if self.rot:
            qk = torch.cat((apply_rope(qk[..., : self.rot], cos, sin), qk[..., self.rot:]), dim=-1)
        return qk[:, :hq], qk[:, hq:], v.view(n, hkv, hd), gate

    def forward(self, x: Tensor, kv, li: int, ctx) -> Tensor:
        """x ``[n, hidden]`` (normed) -> gated attention output ``[n, heads*head_dim]`` (before o_proj).
        K/V of the n rows go to ``kv`` layer ``li`` (rows ``[kv.length, +n)`` or ``ctx.rows``)."""
        n, hq, hkv, hd = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        q, k, v, gate = self.project(x, ctx.cos, ctx.sin)
        if ctx.rows is None:
            s = kv.length
            kv_len = s + n
            kv.k[li, :, s:kv_len] = k.transpose(0, 1)
            kv.v[li, :, s:kv_len] = v.transpose(0, 1)
        else:
            kv_len = ctx.kv_len
            kv.k[li].index_copy_(1, ctx.rows, k.transpose(0, 1))
            kv.v[li].index_copy_(1, ctx.rows, v.transpose(0, 1))
        if getattr(ctx, "start", None) is not None and kernels_usable(hd, kv.k):
            # split-K kernel over the live rows [0, start + n) (the graphed path; block: the
            # bucket's [N, N] mask, padding rows see only themselves)
            mode = "causal" if ctx.block is None else "tree"
            out = decode_attention(q, kv.k[li], kv.v[li], ctx.start, mode, ctx.block).reshape(n, hq * hd)
            return out * torch.sigmoid(gate)
        rep = hq // hkv  # GQA without repeating K/V: rep query heads per KV head become rep*n rows
        q = q.transpose(0, 1).reshape(1, hkv, rep * n, hd)
        out = F.scaled_dot_product_attention(q, kv.k[li, :, :kv_len][None], kv.v[li, :, :kv_len][None],
                                             attn_mask=ctx.mask)
        out = out.reshape(hq, n, hd).transpose(0, 1).reshape(n, hq * hd)
        return out * torch.sigmoid(gate)


class HybridLayer(nn.Module):
    """Pre-norm decoder layer: GDN or gated attention, then the SwiGLU MLP (fused gate|up)."""

    def __init__(self, cfg, kind: str, index: int):
        super().__init__()
        self.kind, self.index = kind, index  # index among the layers of its kind
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == GDN:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cache, ctx) -> Tensor:
        h = self.input_layernorm(x)
        if self.kind == GDN:
            x = linear_add(x, self.linear_attn(h, cache, self.index, ctx), self.linear_attn.out_proj)
        else:
            x = linear_add(x, self.self_attn(h, cache.kv, self.index, ctx), self.self_attn.o_proj)
        return linear_add(x, self.mlp.hidden(self.post_attention_layernorm(x)), self.mlp.down_proj)
