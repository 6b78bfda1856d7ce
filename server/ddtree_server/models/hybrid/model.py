"""HybridTarget: our own Qwen3.5 / Qwen3.6 forward (Gated DeltaNet + gated attention) with tree
verification, behind the dense TargetModel's calling convention (docs/architecture.md):

    logits, feats = target.forward(cache, ids [n], positions [n], tree_mask [n, n] | None)
    cache.keep(start, path)          # after the acceptance walk

so engine/decode.py runs ar / dflash / ddtree unchanged. Attention layers see the ancestor mask
and compact their K/V like dense targets; GDN layers give every node the conv window and the
recurrent state of its own root path and commit the accepted path's states in ``keep``
(``cache.py``). Tree metadata (parents, conv windows) is built once per forward (``tree.py``).

GDN tree method (``method``): ``chunk`` (default) = tree-masked chunked delta rule, one
unit-lower-triangular solve per layer, commit by a closed-form fold over the accepted path;
``node`` = sequential per-node states, commit by copying the accepted node's state. Both are
exact (tests/server/test_hybrid_tree.py checks each against the other and against chains).
Default ``chunk`` because its verify scratch is O(nodes x (Kd + Vd)) per head instead of
O(nodes x Kd x Vd) (2.2 MiB vs 144 MiB per node at the Qwen3.6-27B shape, docs/hybrid.md) and
its work per layer is a few batched matmuls instead of one small step per node; the GPU timing of
both (``python -m ddtree_server.bench.hybrid_verify``) decides it for good (docs/hybrid.md).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from ddtree_server.models.hybrid.cache import HybridCache, VerifyScratch
from ddtree_server.models.hybrid.config import GDN, HybridConfig
from ddtree_server.models.hybrid.layers import HybridLayer, ZeroCenteredRMSNorm
from ddtree_server.models.hybrid.tree import tree_meta
from ddtree_server.models.layers import attention_backends, kernels_usable

METHODS = ("chunk", "node")
DEFAULT_METHOD = os.environ.get("DDTREE_GDN_METHOD", "chunk")
TREE_ROWS = 80  # scratch rows per request: trees up to 80 nodes (DDTree budget 64 -> 65 nodes)


class HybridTarget(nn.Module):
    """Qwen3.5-family causal LM over a HybridCache; see the module docstring.

    Parameter names are transformers' without the ``model.`` / ``model.language_model.`` prefix,
    with fused projections (``linear_attn.in_proj``, ``self_attn.qkv_proj``, ``mlp.gate_up_proj``;
    ``hybrid.load.fuse_state`` maps a checkpoint). ``capture_layers``: decoder-layer ids whose
    outputs ``forward`` returns (the drafter's ``target_layer_ids``).
    """

    zero_centered_norms = True

    def __init__(self, config, method: str = DEFAULT_METHOD):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"unknown GDN tree method {method!r}; use one of {METHODS}")
        self.config = cfg = HybridConfig.from_any(config)
        self.method = method
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counts = {GDN: 0, "full_attention": 0}
        layers = []
        for kind in cfg.layer_types:
            layers.append(HybridLayer(cfg, kind, counts[kind]))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rep = cfg.num_attention_heads // cfg.num_key_value_heads
        rot = cfg.rotary_dim
        self._inv_freq = {torch.device("cpu"): 1.0 / cfg.rope_theta ** (
            torch.arange(0, rot, 2, dtype=torch.int64, device="cpu").float() / rot)}
        self.capture_layers: list[int] = []

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, max_len: int, spare_rows: int = 0, tree_rows: int = TREE_ROWS,
                  scratch: VerifyScratch | None = None) -> HybridCache:
        """A fresh HybridCache of ``max_len`` rows for trees of ``tree_rows`` nodes: its own verify
        scratch, or views of ``scratch`` (shared; then trees of at most its rows)."""
        w = self.embed_tokens.weight
        return HybridCache(self.config, self.method, max_len, tree_rows, w.dtype, w.device, spare_rows, scratch)

    def new_scratch(self, rows: int, device=None) -> VerifyScratch:
        """A verify scratch of ``rows`` rows shared by many caches (the batch engine's round
        scratch; ``device="meta"`` sizes it without memory)."""
        w = self.embed_tokens.weight
        return VerifyScratch(self.config, self.method, rows, device or w.device, shared=True, dtype=w.dtype)

    def rope(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin ``[n, 1, rotary_dim]`` (the sign of rotate_half folded into sin)."""
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _attn_mask(self, s: int, n: int, tree_mask: Tensor | None, device) -> Tensor | None:
        if tree_mask is None and n == 1:
            return None
        mask = torch.ones((n, s + n), dtype=torch.bool, device=device)
        block = torch.ones((n, n), dtype=torch.bool, device=device).tril_() if tree_mask is None else tree_mask
        mask[:, s:] = block
        return mask.repeat(self.rep, 1)[None, None]

    def forward(self, cache: HybridCache, input_ids: Tensor, positions: Tensor,
                tree_mask: Tensor | None = None, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """Run n new rows after ``cache.length`` (see TargetModel.forward for the arguments).

        A causal block of 1 row, a prefill (``last_only``: chunked form) or a causal block of
        more rows than the cache's tree scratch is committed at once; other blocks stay pending until ``cache.keep`` (or the next forward commits a
        pending chain in full); a tree larger than the scratch grows it. Raises ValueError
        (cache full, bad mask shape) or RuntimeError (the previous tree was not committed)."""
        n, s = input_ids.shape[0], cache.length
        if s + n > cache.max_len:
            raise ValueError(f"KV cache full: {s} + {n} rows > max_len {cache.max_len}")
        if tree_mask is not None and tuple(tree_mask.shape) != (n, n):
            raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({n}, {n})")
        cache.settle()
        s = cache.length
        commit = tree_mask is None and (n == 1 or n > cache.cap or last_only)
        if tree_mask is not None and n > cache.cap:
            cache.grow(-(-n // 16) * 16)  # a larger tree than the static scratch: grow it once
        start = None
        if tree_mask is None and kernels_usable(self.config.head_dim, cache.k):
            # a chain (a prompt above all) on the split-K kernel: no [rep*n, s+n] mask, which
            # for a 131k-token prompt would take ~100 GB (docs/architecture.md, "Long contexts")
            mask, start = None, torch.full((), s, dtype=torch.long, device=input_ids.device)
        else:
            mask = self._attn_mask(s, n, tree_mask, input_ids.device)
        out = self.run(cache, input_ids, positions, mask, tree_mask, last_only=last_only, commit=commit,
                       chain=tree_mask is None, start=start)
        cache.begin(s, n, tree_mask is not None, commit)
        return out

    def run(self, cache: HybridCache, input_ids: Tensor, positions: Tensor, mask: Tensor | None,
            block: Tensor | None, rows: Tensor | None = None, kv_len: int | None = None,
            last_only: bool = False, commit: bool = False, chain: bool = False, start: Tensor | None = None
            ) -> tuple[Tensor, Tensor | None]:
        """The layer stack without bookkeeping (``forward`` and CUDA graphs).

        mask: attention mask (bool or additive) ``[1, 1, rep*n, kv_len]`` or None; block: bool
        ``[n, n]`` ancestor-or-self mask (None with ``chain``: causal); rows / kv_len: static K/V
        rows and key window (CUDA graphs); commit: the block is a chain committed at once;
        start: 0-d device tensor = cache rows before the block (GraphedHybrid): the attention
        layers may then take the split-K kernel over the live rows (kernels/attention.py)."""
        x = self.embed_tokens(input_ids)
        n = x.shape[0]
        cos, sin = self.rope(positions, x.dtype)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
        meta = tree_meta(None if chain else block, n, self.config.linear_conv_kernel_dim, x.device)
        if not commit and n <= cache.cap:
            cache.win[:n] = meta.win
        ctx = SimpleNamespace(cos=cos, sin=sin, mask=mask, rows=rows, kv_len=kv_len, meta=meta,
                              mode="commit" if commit else self.method, start=start, block=block)
        want = {layer: i for i, layer in enumerate(self.capture_layers)}
        captured: list[Tensor | None] = [None] * len(want)
        with attention_backends(x.device):
            for i, layer in enumerate(self.layers):
                x = layer(x, cache, ctx)
                if i in want:
                    captured[want[i]] = x
        if last_only:
            x = x[-1:]
        logits = self.lm_head(self.norm(x))
        return logits, (torch.cat(captured, dim=-1) if captured else None)
