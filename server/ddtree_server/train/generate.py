"""Batched answers of a frozen transformers target with a static KV cache (data generation).

transformers' `generate()` with its dynamic cache grows every layer's K/V by concatenation at each
step (and repeats the grouped K/V heads for attention), so at batch 2048 a 135 M-parameter model
spends ~100 ms per step on copies. `StaticGenerator` runs the same decoder layers (the target's own
modules and weights) with:
  * one preallocated cache per layer, [B, kv_heads, prompt_width + max_new, head_dim], written in
    place; prompts are left-padded so that every row writes the same column at every step;
  * decode attention over the filled columns only, with the query heads of a K/V group folded
    into the query axis ([B, kv_heads, group, head_dim], exact for one query token), so the
    grouped K/V are never repeated; a boolean key mask hides the left padding;
  * the prefill in row chunks (bounded activation memory), pad rows attending to themselves only
    (so no fully-masked row produces NaN K/V);
  * SDPA kept off cuDNN, which would plan anew at every step (the key length grows by one).
Row r of a batch is answered greedily or, if `sampled[r]`, by sampling softmax(logits / T) (no
top-k / top-p), like `generate(do_sample=True, top_k=0, top_p=1.0)`.

Supports decoder-only models whose layers hold `self_attn.{q,k,v,o}_proj` (optional per-head
`q_norm` / `k_norm`, Qwen3), `input_layernorm`, `post_attention_layernorm`, `mlp`, with a
`rotary_emb(x, position_ids)` on the decoder (Llama, Qwen2/3, Mistral families). `supports()` says
whether a model qualifies; the pipeline falls back to `generate()` otherwise (train/data.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.models.layers import attention_backends
from ddtree_server.train.features import decoder_of


def supports(model: nn.Module) -> bool:
    """True when the target's layers have the shape this generator drives (see the module docstring)."""
    try:
        dec = decoder_of(model)
    except ValueError:
        return False
    if not callable(getattr(dec, "rotary_emb", None)) or getattr(dec, "norm", None) is None:
        return False
    if getattr(model, "lm_head", None) is None or getattr(dec, "embed_tokens", None) is None:
        return False
    need = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")
    for layer in dec.layers:
        if not all(hasattr(layer, n) for n in need):
            return False
        if not all(hasattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if getattr(layer, "attention_type", "full_attention") != "full_attention":
            return False
    return True


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half form). x: [B, heads, T, hd]; cos/sin: [B, T, hd]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rot * sin[:, None]


class StaticGenerator:
    """Greedy / sampled batched generation for one target (see the module docstring).

    model: a transformers causal LM in eval mode (any dtype / device); eos_ids: stop tokens.
    """

    def __init__(self, model: nn.Module, eos_ids: list[int]) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__}: layer layout not supported by StaticGenerator")
        self.model, self.dec = model, decoder_of(model)
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], dtype=torch.long)
        self.prefill_rows = 256

    @property
    def device(self) -> torch.device:
        return self.dec.embed_tokens.weight.device

    def _qkv(self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(b, t, self.n_kv, self.head_dim)
        v = attn.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin), v

    def _scale(self, attn: nn.Module) -> float:
        return float(getattr(attn, "scaling", self.head_dim ** -0.5))

    def _prefill(self, ids: Tensor, pad: Tensor, caches: list[tuple[Tensor, Tensor]], r0: int) -> Tensor:
        """Rows [r0, r0+len(ids)) of the batch: fill caches[:, :, :P] and return last logits [b, V]."""
        b, p = ids.shape
        col = torch.arange(p, device=ids.device)
        pos = (col[None] - pad[:, None]).clamp(min=0)
        real = col[None] >= pad[:, None]                                        # [b, P] key is a token
        mask = (col[:, None] >= col[None]) & real[:, None, :]                    # causal, no pad keys
        mask = (mask | torch.eye(p, dtype=torch.bool, device=ids.device))[:, None]  # pads see themselves
        x = self.dec.embed_tokens(ids)
        cos, sin = self.dec.rotary_emb(x, pos)
        rep = self.n_heads // self.n_kv
        for layer, (kc, vc) in zip(self.dec.layers, caches):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            kc[r0:r0 + b, :, :p] = k
            vc[r0:r0 + b, :, :p] = v
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self._scale(attn))
            x = x + attn.o_proj(a.transpose(1, 2).reshape(b, p, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.dec.norm(x[:, -1:]))[:, 0].float()

    def _step(self, tok: Tensor, pos: Tensor, col: int, keys: Tensor, caches: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One decode step for every row: token [B] at positions pos [B], cache column `col`;
        keys: bool [B, 1, 1, col+1] (visible columns). Returns logits [B, V] (fp32)."""
        b = tok.shape[0]
        x = self.dec.embed_tokens(tok[:, None])
        cos, sin = self.dec.rotary_emb(x, pos[:, None])
        group = self.n_heads // self.n_kv
        for layer, (kc, vc) in zip(self.dec.layers, caches):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), cos, sin)
            kc[:, :, col] = k[:, :, 0]
            vc[:, :, col] = v[:, :, 0]
            qg = q.reshape(b, self.n_kv, group, self.head_dim)  # query head h = kv * group + g
            a = F.scaled_dot_product_attention(qg, kc[:, :, :col + 1], vc[:, :, :col + 1], attn_mask=keys,
                                               scale=self._scale(attn))
            x = x + attn.o_proj(a.reshape(b, 1, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.dec.norm(x))[:, 0].float()

    def generate(self, prompts: list[list[int]], sampled: list[bool], *, max_new_tokens: int,
                 temperature: float = 1.0, seed: int = 0, pad_id: int = 0) -> tuple[list[list[int]], int]:
        """Answer every prompt; returns (responses cut after the first stop token, decode steps run).

        prompts: token ids (non-empty); sampled[r]: sample row r at `temperature`, else greedy.
        Stops early once every row has produced a stop token. Raises ValueError for an empty
        prompt or mismatched lengths."""
        if len(prompts) != len(sampled) or any(not p for p in prompts):
            raise ValueError("need one sampled flag per prompt and non-empty prompts")
        with torch.no_grad(), attention_backends(self.device):
            return self._generate(prompts, sampled, max_new_tokens, temperature, seed, pad_id)

    def _generate(self, prompts, sampled, max_new_tokens, temperature, seed, pad_id):
        dev = self.device
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
        ids, pad = ids.to(dev), torch.tensor([width - len(p) for p in prompts], device=dev)
        dtype = self.dec.embed_tokens.weight.dtype
        shape = (b, self.n_kv, width + max_new_tokens, self.head_dim)
        caches = [(torch.empty(shape, device=dev, dtype=dtype), torch.empty(shape, device=dev, dtype=dtype))
                  for _ in self.dec.layers]
        logits = torch.cat([self._prefill(ids[r:r + self.prefill_rows], pad[r:r + self.prefill_rows], caches, r)
                            for r in range(0, b, self.prefill_rows)])
        gen = torch.Generator(device=dev).manual_seed(seed)
        use_sample = torch.tensor(sampled, device=dev)
        eos = self.eos.to(dev)
        out = torch.empty((b, max_new_tokens), dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        keys = torch.ones((b, 1, 1, width + max_new_tokens), dtype=torch.bool, device=dev)
        keys[:, 0, 0, :width] = torch.arange(width, device=dev)[None] >= pad[:, None]
        steps, any_sampled = 0, any(sampled)
        for t in range(max_new_tokens):
            tok = logits.argmax(-1)
            if any_sampled:
                probs = torch.softmax(logits / max(temperature, 1e-6), dim=-1)
                tok = torch.where(use_sample, torch.multinomial(probs, 1, generator=gen)[:, 0], tok)
            out[:, t] = tok
            done |= torch.isin(tok, eos)
            steps = t + 1
            if t + 1 == max_new_tokens or ((t + 1) % 16 == 0 and bool(done.all())):
                break
            logits = self._step(tok, width - pad + t, width + t, keys[..., :width + t + 1], caches)
        rows = out[:, :steps].tolist()
        stop = set(self.eos.tolist())
        return [row[:next((j + 1 for j, x in enumerate(row) if x in stop), len(row))] for row in rows], steps


@torch.no_grad()
def greedy_agreement(model: nn.Module, prompts: list[list[int]], responses: list[list[int]]) -> float:
    """Share of response tokens that equal the model's own argmax under teacher forcing (one
    forward per row). Greedy answers of a correct generator score ~1.0 (fp32) or ~0.97 (bf16 on CPU,
    SmolLM2: near-ties flip); a broken cache or mask scores far lower. Returns 1.0 when there is nothing to check."""
    dev = next(model.parameters()).device
    hit = total = 0
    for p, r in zip(prompts, responses):
        if not r:
            continue
        ids = torch.tensor([p + r], device=dev)
        pred = model(input_ids=ids).logits[0, len(p) - 1:-1].argmax(-1).cpu()
        hit += int((pred == torch.tensor(r)).sum())
        total += len(r)
    return hit / total if total else 1.0
