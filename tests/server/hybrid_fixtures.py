"""Tiny random Qwen3.5 hybrids for the tests: transformers' own model and ours on the same weights.

Configs are small ``Qwen3_5TextConfig``s (conv kernel 4, more value heads than key heads, several
GDN/attention layer patterns). Weights are random with non-trivial norms, gates and decays, scaled
so that next-token distributions are peaked like a trained model's (long greedy agreements).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ddtree_server.models.hybrid.config import HybridConfig
from ddtree_server.models.hybrid.load import build_hybrid

VOCAB = 260
PATTERNS = {
    "3gdn+attn": ["linear_attention"] * 3 + ["full_attention"],
    "2gdn+attn": ["linear_attention"] * 2 + ["full_attention"],   # the fewest layers a drafter on [1, 2] reads
    "attn-first": ["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "qwen3.6x2": (["linear_attention"] * 3 + ["full_attention"]) * 2,  # the 27B pattern, 8 layers
    "mixed6": ["linear_attention", "full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
}


def tiny_config(pattern: str = "3gdn+attn", vocab: int = VOCAB, **kw):
    from transformers import Qwen3_5TextConfig

    types = PATTERNS[pattern]
    args = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=len(types),
                layer_types=types, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=1024,
                tie_word_embeddings=False, eos_token_id=256, pad_token_id=256)
    args.update(kw)
    return Qwen3_5TextConfig(**args)


def random_state(cfg, seed: int = 0, scale: float = 3.0, gain: float = 0.3) -> dict[str, torch.Tensor]:
    """A transformers-named state dict (``model.`` prefix) with seeded random weights.

    Projections have std ``gain / sqrt(fan_in)`` (a random stack with gain 1 amplifies fp32
    rounding ~1000x from input to logits, more than the 1e-4 the equality tests allow); the LM
    head is scaled up by ``scale / gain`` so that next-token distributions stay peaked."""
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        names = {k: v.shape for k, v in Qwen3_5ForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in names.items():
        r = torch.randn(shape, generator=g)
        if name.endswith("linear_attn.norm.weight"):
            out[name] = 1.0 + 0.1 * r
        elif name.endswith("norm.weight"):  # zero-centred RMSNorms: weight around 0
            out[name] = 0.1 * r
        elif name.endswith("A_log"):
            out[name] = torch.empty(shape).uniform_(0.5, 8.0, generator=g).log()
        elif name.endswith("dt_bias"):
            out[name] = 0.5 * r
        elif name.endswith("conv1d.weight"):
            out[name] = 0.2 * r
        else:
            out[name] = gain * r / shape[-1] ** 0.5
    out["lm_head.weight"] = out["lm_head.weight"] * scale / gain
    return out


def hf_model(cfg, state):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM(cfg).eval()
    model.load_state_dict(state, strict=True)
    return model


def ours(cfg, state, method: str = "chunk", dtype=torch.float32):
    stripped = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    return build_hybrid(HybridConfig.from_any(cfg.to_dict()), stripped, dtype, torch.device("cpu"), method)


def tiny_hybrid(pattern: str = "3gdn+attn", seed: int = 0, method: str = "chunk", scale: float = 3.0, **kw):
    """Our HybridTarget (fp32, CPU) on a tiny random config."""
    cfg = tiny_config(pattern, **kw)
    return ours(cfg, random_state(cfg, seed, scale=scale), method)


def tiny_hybrid_ours(pattern: str = "3gdn+attn", seed: int = 0, method: str = "chunk", device: str = "cpu",
                     scale: float = 3.0, gain: float = 0.3):
    """As ``tiny_hybrid`` but without transformers' Qwen3.5 classes (the GPU machine's
    transformers 5.17 may lack them): our config dict, ``target_from_config`` and the same
    initialisation rules applied to our (fused) parameter names. fp32."""
    from ddtree_server.models.random_init import target_from_config

    types = PATTERNS[pattern]
    raw = dict(model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=len(types), layer_types=types, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=1024,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
               eos_token_id=256)
    model = target_from_config(raw, device=device, dtype="fp32", method=method)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("linear_attn.norm.weight"):
                new = 1.0 + 0.1 * r
            elif name.endswith("norm.weight"):
                new = 0.1 * r
            elif name.endswith("A_log"):
                new = torch.empty(p.shape).uniform_(0.5, 8.0, generator=g).log()
            elif name.endswith("dt_bias"):
                new = 0.5 * r
            elif name.endswith("conv1d.weight"):
                new = 0.2 * r
            else:
                new = gain * r / p.shape[-1] ** 0.5 * (scale / gain if name == "lm_head.weight" else 1.0)
            p.copy_(new)
    return model


def random_tree(rng: random.Random, n: int) -> np.ndarray:
    """A random tree of n nodes (each node's parent drawn among the earlier ones): its bool
    ancestor-or-self mask ``[n, n]``."""
    anc = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if i:
            anc[i] = anc[rng.randrange(i)]
        anc[i, i] = True
    return anc
