"""DFlashDrafter: the z-lab DFlash block drafter and its draft KV cache.

Source: DFlash (arXiv 2602.06036), z-lab/dflash `dflash/model.py`; docs/ddtree.md §1.1-§1.6.
Parameter names equal the z-lab checkpoint keys (docs/ddtree.md §1.3): `fc`, `hidden_norm`,
`layers.{i}.*`, `norm`. The token embedding and the LM head belong to the target; they are passed in
and are NOT part of this module's state dict or parameters (so an optimizer over `parameters()`
never touches them).

Forward (docs/ddtree.md §1.5): target features of the context -> `hidden_norm(fc(.))`, shared by
every layer as extra keys/values; the block `[bonus, MASK * (bs-1)]` gives the queries; attention is
non-causal over all context and the whole block; row j >= 1 predicts the token AT position s+j.
Sliding-window layers (``layer_types``, e.g. the z-lab Qwen3.6 drafters) are causal with a key
window instead (``drafter/attention.py``: ``visibility``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ddtree_server.models.drafter.attention import visibility
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.layers import DFlashLayer, hf_config
from ddtree_server.models.layers import RMSNorm, attention_backends, rope_inv_freq


class DraftCache:
    """Context K/V of one sequence for every draft layer (docs/ddtree.md §1.6).

    k, v: [num_layers, num_kv_heads, max_len, head_dim]; rows [0, length) are valid; row p holds
    the K/V of the committed token at absolute position p.
    """

    def __init__(self, config: DrafterConfig, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.num_hidden_layers, config.num_key_value_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep rows [0, length); raises ValueError if length is out of [0, self.length]."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        self.length = length


class DFlashDrafter(nn.Module):
    """The DFlash drafter; see the module docstring. Sizes come from `config` (DrafterConfig)."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._shared = (embed_tokens, lm_head)  # a tuple: not registered as submodules
        rope = dict(config.rope_parameters)
        plain = rope.get("rope_type", rope.get("type", "default")) == "default"
        with torch.device("cpu"):  # real numbers even when the module is built on the meta device
            inv_freq, scale = rope_inv_freq(config if plain else hf_config(config))
        self._inv_freq = inv_freq.float()  # kept in fp32 whatever the module dtype
        self._rope_scale = float(scale)
        self._inv_freq_dev: dict[torch.device, Tensor] = {}
        self.kinds = [config.attention_kind(i) for i in range(config.num_hidden_layers)]
        self._rope_tab: dict[tuple, tuple[Tensor, Tensor]] = {}

    @property
    def embed_tokens(self) -> nn.Module:
        """The target's token embedding (shared, frozen): ids [...] -> [..., H]."""
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        """The target's LM head (shared, frozen): [..., H] -> logits [..., vocab]."""
        return self._shared[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: long [B, T] (absolute token positions) -> cos, sin [B, T, head_dim] in dtype.
        Computed in fp32 from the drafter's own rope settings (never the target's)."""
        dev = positions.device
        inv = self._inv_freq_dev.get(dev)
        if inv is None:
            inv = self._inv_freq_dev[dev] = self._inv_freq.to(dev)
        freqs = positions.float()[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._rope_scale).to(dtype), (emb.sin() * self._rope_scale).to(dtype)

    def rope_range(self, start: int, end: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [1, end-start, head_dim] of positions [start, end), sliced from a cached table
        (grown by doubling; same values as `rope`), so inference needs no per-call rope kernels."""
        key = (device, dtype)
        tab = self._rope_tab.get(key)
        if tab is None or tab[0].shape[0] < end:
            n = max(1024, 1 << max(0, end - 1).bit_length())
            cos, sin = self.rope(torch.arange(n, device=device)[None], dtype)
            tab = self._rope_tab[key] = (cos[0], sin[0])
        return tab[0][None, start:end], tab[1][None, start:end]

    def project_context(self, ctx: Tensor) -> Tensor:
        """ctx: [..., len(target_layer_ids) * H] target features -> hidden_norm(fc(ctx)) [..., H]."""
        return self.hidden_norm(self.fc(ctx.to(self.dtype)))

    def block_ids(self, first: Tensor) -> Tensor:
        """first: long [...] clean tokens -> [..., block_size] = [first, MASK, ..., MASK]."""
        ids = torch.full((*first.shape, self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=first.device)
        ids[..., 0] = first
        return ids

    # ------------------------------------------------------------------ inference (batch 1)
    def new_cache(self, max_len: int) -> DraftCache:
        """An empty DraftCache for up to `max_len` positions (context + one block), on this module's device."""
        return DraftCache(self.config, max_len, self.fc.weight.device, self.dtype)

    @torch.no_grad()
    def append_context(self, cache: DraftCache, ctx: Tensor, start_pos: int) -> None:
        """Append the K/V of the features ctx [n, L*H] of positions [cache.length, start_pos).
        Raises ValueError if n != start_pos - cache.length or the cache is too short for a block."""
        c0, n = cache.length, ctx.shape[0]
        if c0 + n != start_pos:
            raise ValueError(f"context of {n} rows does not fill positions [{c0}, {start_pos})")
        if start_pos + self.config.block_size > cache.max_len:
            raise ValueError(f"draft cache of {cache.max_len} rows cannot hold a block at {start_pos}")
        if n:
            h = self.project_context(ctx)[None]
            cos, sin = self.rope_range(c0, start_pos, h.device, h.dtype)
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.kv(h, cos, sin)
                cache.k[i, :, c0:start_pos] = k[0]
                cache.v[i, :, c0:start_pos] = v[0]
        cache.length = start_pos

    @torch.no_grad()
    def draft_block(self, cache: DraftCache, bonus_token: int | Tensor) -> Tensor:
        """Draft the block at [cache.length, cache.length + block_size) after the cached context.

        bonus_token: the verified token at position s = cache.length (int or 0-d long tensor).
        Returns logits [block_size - 1, vocab] for positions s+1 .. s+block_size-1. The block's
        own K/V are written past `length` and dropped (cache.length stays s)."""
        s, bs = cache.length, self.config.block_size
        ids = torch.full((1, bs), self.config.mask_token_id, dtype=torch.long, device=cache.k.device)
        ids[0, 0] = bonus_token  # an int or a device tensor: no host sync either way
        x = self.embed_tokens(ids).to(self.dtype)  # [1, bs, H]
        cos, sin = self.rope_range(s, s + bs, x.device, x.dtype)
        masks = self._masks(torch.arange(s, s + bs, device=x.device), torch.arange(s + bs, device=x.device))
        with attention_backends(x.device):
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                xn = layer.input_layernorm(x)
                k, v = attn.kv(xn, cos, sin)
                cache.k[i, :, s:s + bs] = k[0]
                cache.v[i, :, s:s + bs] = v[0]
                out = attn.attend(attn.q(xn, cos, sin), cache.k[i, None, :, :s + bs],
                                  cache.v[i, None, :, :s + bs], masks[self.kinds[i]])
                x = layer.finish(x, out)
        return self.lm_head(self.norm(x[0, 1:]))

    def _masks(self, q_pos: Tensor, k_pos: Tensor) -> dict:
        """kind -> bool mask ``[..., 1, Tq, Tk]`` (None for full layers), one per distinct kind."""
        out = {}
        for kind in set(self.kinds):
            see = visibility(q_pos, k_pos, kind)
            out[kind] = None if see is None else see.unsqueeze(-3) if see.dim() > 2 else see[None, None]
        return out

    def propose(self, cache: DraftCache, ctx: Tensor, bonus_token: int | Tensor, start_pos: int) -> Tensor:
        """Contract call (docs/architecture.md): append ctx [n, L*H] (positions [cache.length,
        start_pos)), draft the block at start_pos; returns logits [block_size-1, vocab];
        afterwards cache.length == start_pos."""
        self.append_context(cache, ctx, start_pos)
        return self.draft_block(cache, bonus_token)

    # ------------------------------------------------------------------ reference / training
    def forward(self, ctx: Tensor, block_ids: Tensor) -> Tensor:
        """From-scratch forward exactly as the z-lab module (docs/ddtree.md §1.5), no cache.

        ctx: [B, s, L*H] features of positions [0, s); block_ids: long [B, block_size] at
        positions [s, s+block_size). Returns logits [B, block_size-1, vocab] (rows 1..bs-1)."""
        b, s, _ = ctx.shape
        bs = block_ids.shape[1]
        h = self.project_context(ctx)
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = self.rope(torch.arange(s + bs, device=x.device).expand(b, -1), x.dtype)
        masks = self._masks(torch.arange(s, s + bs, device=x.device), torch.arange(s + bs, device=x.device))
        with attention_backends(x.device):
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                xn = layer.input_layernorm(x)
                k, v = attn.kv(torch.cat([h, xn], dim=1), cos, sin)
                x = layer.finish(x, attn.attend(attn.q(xn, cos[:, s:], sin[:, s:]), k, v, masks[self.kinds[i]]))
        return self.lm_head(self.norm(x[:, 1:]))

    def forward_train(self, ctx: Tensor, input_ids: Tensor, anchors: Tensor, anchor_valid: Tensor) -> Tensor:
        """Block-diffusion training forward: many anchor blocks per sequence in one pass.

        ctx: [B, T, L*H] target features of every position; input_ids: long [B, T];
        anchors: long [B, A] block start positions (the clean anchor token input_ids[b, a] sits
        in slot 0, slots 1..bs-1 are MASK at positions a+1..a+bs-1); anchor_valid: bool [B, A].
        Block (b, i) sees context positions p < anchors[b, i] and its own block (bidirectional);
        an invalid anchor sees only its own block. Returns final-normed hidden [B, A, bs, H];
        apply `lm_head` to rows 1..bs-1 for logits (row j predicts input_ids[b, a+j])."""
        b, t = input_ids.shape
        a, bs = anchors.shape[1], self.config.block_size
        blk_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(b, a * bs)
        x = self.embed_tokens(self.block_ids(input_ids.gather(1, anchors))).to(self.dtype).reshape(b, a * bs, -1)
        h = self.project_context(ctx)
        cos_c, sin_c = self.rope(torch.arange(t, device=x.device).expand(b, -1), x.dtype)
        cos_b, sin_b = self.rope(blk_pos, x.dtype)
        see_ctx = (torch.arange(t, device=x.device) < anchors[:, :, None]) & anchor_valid[:, :, None]  # [B, A, T]
        blk = torch.arange(a * bs, device=x.device) // bs
        see_blk = (blk[:, None] == blk[None, :]).expand(b, -1, -1)  # [B, A*bs, A*bs]
        see = torch.cat([see_ctx.repeat_interleave(bs, dim=1), see_blk], dim=2)  # [B, A*bs, T + A*bs]
        k_pos = torch.cat([torch.arange(t, device=x.device).expand(b, -1), blk_pos], dim=1)
        masks = {kind: (see if extra is None else see & extra)[:, None]
                 for kind in set(self.kinds) for extra in [visibility(blk_pos, k_pos, kind)]}
        with attention_backends(x.device):
            for i, layer in enumerate(self.layers):
                mask = masks[self.kinds[i]]
                attn = layer.self_attn
                xn = layer.input_layernorm(x)
                kc, vc = attn.kv(h, cos_c, sin_c)
                kb, vb = attn.kv(xn, cos_b, sin_b)
                out = attn.attend(attn.q(xn, cos_b, sin_b), torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), mask)
                x = layer.finish(x, out)
        return self.norm(x).reshape(b, a, bs, -1)
