"""TargetModel: our own Llama-family forward (Llama, Mistral, Qwen2, Qwen3) with a static KV cache.

Why our own forward (docs/ddtree.md §2.3, §3.1): tree verification needs explicit positions
(s + depth), an ancestor mask over the new block, in-place KV compaction and hidden states of a
few chosen layers; owning the cache avoids the transformers cache API churn between 5.17 and 5.24.
The maths mirrors transformers' Llama/Qwen2/Qwen3 modules (RMSNorm in fp32, RoPE from
``transformers.modeling_rope_utils`` so ``rope_parameters`` incl. llama3/yarn/linear scaling are
honoured, GQA attention through ``torch.nn.functional.scaled_dot_product_attention``, SwiGLU MLP).

Batch size is 1 throughout: token tensors are 1-D ``[n]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.models.dense import fast
from ddtree_server.models.dense.fast import FastBlock
from ddtree_server.models.kv_cache import KVCache
from ddtree_server.models.layers import (MLP, RMSNorm, apply_rope, attention_backends, kernels_usable, linear_add,
                                         rope_inv_freq)


class Attention(nn.Module):
    """GQA self-attention with a fused q/k/v projection; optional q/k/v bias (Qwen2) and per-head
    q/k RMSNorm (Qwen3). The output projection is applied by the caller (fused residual add)."""

    def __init__(self, config, qk_norm: bool):
        super().__init__()
        hidden = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.n_heads
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(hidden, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int,
                mask: Tensor | FastBlock | None, rows: Tensor | None = None, kv_len: int | None = None) -> Tensor:
        """x ``[n, hidden]`` (normed) -> attention output ``[n, heads*head_dim]`` (before o_proj).

        Eager: K/V go to rows ``[cache.length, +n)`` and attention reads ``cache.length + n``
        rows. Static (CUDA graphs): K/V go to ``rows`` (long ``[n]``) and attention reads
        ``kv_len`` rows; ``mask`` then decides visibility. A FastBlock mask: the kernel path
        (models/dense/fast.py), rows / kv_len unused.
        """
        if isinstance(mask, FastBlock):
            return fast.target_attention(self, x, cos, sin, cache, layer, mask)
        n = x.shape[0]
        hq, hkv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(n, hq + 2 * hkv, self.head_dim)
        qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv:]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :hq]), self.k_norm(qk[:, hq:])), dim=1)
        qk = apply_rope(qk, cos, sin)  # queries and keys at once; sin carries rotate_half's sign
        q, k = qk[:, :hq], qk[:, hq:]
        if rows is None:
            s = cache.length
            kv_len = s + n
            cache.k[layer, :, s:kv_len] = k.transpose(0, 1)
            cache.v[layer, :, s:kv_len] = v.transpose(0, 1)
        else:
            cache.k[layer].index_copy_(1, rows, k.transpose(0, 1))
            cache.v[layer].index_copy_(1, rows, v.transpose(0, 1))
        keys = cache.k[layer, :, :kv_len].unsqueeze(0)
        values = cache.v[layer, :, :kv_len].unsqueeze(0)
        # GQA without repeating K/V: the rep query heads of one KV head become rep*n query rows.
        rep = hq // hkv
        q = q.transpose(0, 1).reshape(1, hkv, rep * n, self.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return out.reshape(hq, n, self.head_dim).transpose(0, 1).reshape(n, -1)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention and MLP residual blocks."""

    def __init__(self, config, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, layer, mask, rows=None, kv_len=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, rows, kv_len)
        x = linear_add(x, attn, self.self_attn.o_proj)
        h = self.post_attention_layernorm(x)
        h = fast.mlp_hidden(self.mlp, h) if isinstance(mask, FastBlock) else self.mlp.hidden(h)
        return linear_add(x, h, self.mlp.down_proj)


TREE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class TargetModel(nn.Module):
    """Llama-family causal LM over a static KV cache, with explicit positions and tree masks.

    Parameter names equal transformers' without the ``model.`` prefix, except that q/k/v and
    gate/up are stored fused (``self_attn.qkv_proj``, ``mlp.gate_up_proj``);
    ``models.dense.load.fuse_hf_state`` maps a transformers state dict. ``capture_layers`` lists
    decoder-layer ids (0-based; id k = output of decoder layer k) whose outputs ``forward`` returns.
    """

    def __init__(self, config):
        super().__init__()
        if config.model_type not in TREE_FAMILIES:
            raise ValueError(f"TargetModel supports {TREE_FAMILIES}, not {config.model_type!r}")
        self.config = config
        qk_norm = config.model_type == "qwen3"
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if weight.device.type != "meta":
            nn.init.normal_(weight)   # nn.Embedding's own initialisation (the same random numbers)
        # built under torch.device("meta") (models/dense/load.py) the weight is replaced by the
        # loaded one; normal_ on a meta tensor would import torch._dynamo (0.85 s of CPU per load)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.head_dim = self.layers[0].self_attn.head_dim
        with torch.device("cpu"):
            inv_freq, self.rope_scaling = rope_inv_freq(config)
        self._inv_freq = {torch.device("cpu"): inv_freq}
        self._rope_tables: dict = {}  # kernel path: cos / sin of every position (models/dense/fast.py)
        self.capture_layers: list[int] = []

    def tie_weights(self) -> None:
        """Re-share ``lm_head.weight`` with ``embed_tokens.weight`` for tied-embedding configs."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, max_len: int, spare_rows: int = 0) -> KVCache:
        """A fresh KVCache of ``max_len`` rows (+ scratch rows) in this model's dtype/device."""
        w = self.embed_tokens.weight
        return KVCache(len(self.layers), self.config.num_key_value_heads, max_len, self.head_dim,
                       w.dtype, w.device, spare_rows)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin ``[n, 1, head_dim]`` (see ``apply_rope``) of positions ``[n]``."""
        device = positions.device
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = self._inv_freq[torch.device("cpu")].to(device)
            self._inv_freq[device] = inv
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scaling).to(dtype)[:, None, :]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # sign of rotate_half

    def _mask(self, s: int, n: int, tree_mask: Tensor | None, device) -> Tensor | None:
        """Bool ``[1, 1, rep*n, s+n]`` (True = attend) or None when everything is visible."""
        if tree_mask is None and n == 1:
            return None
        mask = torch.ones((n, s + n), dtype=torch.bool, device=device)
        if tree_mask is None:
            mask[:, s:] = torch.ones((n, n), dtype=torch.bool, device=device).tril_()
        else:
            mask[:, s:] = tree_mask
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        return mask.repeat(rep, 1)[None, None]

    def forward(self, cache: KVCache, input_ids: Tensor, positions: Tensor,
                tree_mask: Tensor | None = None, last_only: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """Run ``n`` new tokens after the ``cache.length`` cached ones and append their K/V.

        Args:
            cache: the request's KVCache; ``cache.length`` grows by n.
            input_ids: ``[n]`` long token ids.
            positions: ``[n]`` long RoPE positions (s + depth for tree nodes).
            tree_mask: optional bool ``[n, n]``, True where column j is an ancestor-or-self of row
                i; replaces the causal mask inside the new block (the cached prefix stays fully
                visible). None = causal.
            last_only: return logits for the last row only (prefill).
        Returns:
            logits ``[n, vocab]`` (``[1, vocab]`` with last_only) in the model dtype, and the
            captured features ``[n, len(capture_layers) * hidden]`` (None if nothing is captured).
        Raises:
            ValueError: the cache has fewer than n free rows, or the mask shape is wrong.
        """
        n = input_ids.shape[0]
        s = cache.length
        if s + n > cache.max_len:
            raise ValueError(f"KV cache full: {s} + {n} rows > max_len {cache.max_len}")
        if tree_mask is not None and tree_mask.shape != (n, n):
            raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({n}, {n})")
        if kernels_usable(self.head_dim, self.embed_tokens.weight):
            mode = "causal" if tree_mask is None else "tree"
            mask = FastBlock(fast.start_tensor(s, input_ids.device), mode, tree_mask)
        else:
            mask = self._mask(s, n, tree_mask, input_ids.device)
        logits, feats = self.run(cache, input_ids, positions, mask, last_only=last_only)
        cache.length = s + n
        return logits, feats

    def run(self, cache: KVCache, input_ids: Tensor, positions: Tensor, mask: Tensor | FastBlock | None,
            rows: Tensor | None = None, kv_len: int | None = None, last_only: bool = False
            ) -> tuple[Tensor, Tensor | None]:
        """The layer stack without cache-length bookkeeping (``forward`` and CUDA graphs).

        mask: bool ``[1, 1, rep*n, kv_len]``, None, or a FastBlock (kernel path); rows / kv_len:
        see ``Attention.forward``.
        """
        x = self.embed_tokens(input_ids)
        if isinstance(mask, FastBlock):
            cos, sin = fast.rope(self, positions, cache.k.shape[2], x.dtype)
        else:
            cos, sin = self._rope(positions, x.dtype)
        if isinstance(mask, Tensor) and mask.dtype == torch.bool:
            # additive form once per forward; SDPA would otherwise convert the bool mask per layer
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        want = {layer: i for i, layer in enumerate(self.capture_layers)}
        captured: list[Tensor | None] = [None] * len(want)
        with attention_backends(x.device):
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, cache, i, mask, rows, kv_len)
                if i in want:
                    captured[want[i]] = x
        if last_only:
            x = x[-1:]
        logits = self.lm_head(self.norm(x))
        feats = torch.cat(captured, dim=-1) if captured else None
        return logits, feats
