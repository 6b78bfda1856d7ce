"""Shared helpers for the drafter tests: a scaled-down copy of a published z-lab config.

The config below is `z-lab/Qwen3-8B-DFlash-b16`'s config.json (keys and non-size values as listed
in docs/ddtree.md §1.2) with the sizes scaled down so that the tests run in milliseconds.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# z-lab/Qwen3-8B-DFlash-b16 config.json, sizes scaled down (4096 -> 64 hidden, 36 -> 8 target layers, ...)
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 250, "target_layer_ids": [1, 3, 5]},
    "eos_token_id": 151645,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 160,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 256,
}
TARGET_HIDDEN, TARGET_LAYERS, VOCAB = 64, 8, 256


def zlab_config(**changes) -> dict:
    """A deep copy of ZLAB_CONFIG with top-level keys replaced."""
    cfg = copy.deepcopy(ZLAB_CONFIG)
    cfg.update(changes)
    return cfg


def target_parts(seed: int = 0, hidden: int = TARGET_HIDDEN, vocab: int = VOCAB,
                 dtype: torch.dtype = torch.float32) -> tuple[nn.Embedding, nn.Linear]:
    """A random 'target' embedding and untied LM head (frozen)."""
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(vocab, hidden)
    head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(vocab, hidden, generator=g))
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden ** 0.5)
    return emb.to(dtype).requires_grad_(False), head.to(dtype).requires_grad_(False)


def randomize(module: nn.Module, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Fill every parameter with seeded noise (norm weights around 1) so that outputs are non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_((1.0 + 0.1 * noise) if name.endswith("norm.weight") else scale * noise)
    return module


def qwen36_drafter_config(hidden: int = 64, vocab: int = 260, mask: int = 257,
                          layer_ids=(1, 2, 4, 5, 7), target_layers: int = 8, window: int = 8) -> dict:
    """A scaled-down copy of z-lab/Qwen3.6-27B-DFlash's config.json (ddtree_server.models.hybrid
    .shapes.QWEN36_27B_DRAFTER: 4 sliding layers + 1 full layer, block 16, target ids
    [1, 16, 31, 46, 61] of 64 layers) for a tiny hybrid target: widths / 80, ids scaled to
    ``target_layers`` layers, the 2048 window scaled to ``window``."""
    from ddtree_server.models.hybrid.shapes import QWEN36_27B_DRAFTER

    cfg = copy.deepcopy(QWEN36_27B_DRAFTER)
    cfg.update(hidden_size=hidden, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               vocab_size=vocab, num_target_layers=target_layers, sliding_window=window,
               max_position_embeddings=4096)
    cfg["dflash_config"] = {"mask_token_id": mask, "target_layer_ids": list(layer_ids)}
    return cfg


def shipped_drafter(loaded, device: str = "cpu", dtype: torch.dtype | None = None):
    """The shipped drafter (``server/ddtree_server/assets/drafter``) on a loaded SmolLM2 (the
    ``smollm2`` fixture or ``models.default``'s loader: ``.config`` and ``.model``)."""
    from ddtree_server.models import default
    from ddtree_server.models.drafter.load import load_drafter

    cfg, model = loaded.config, loaded.model
    return load_drafter(default.default_drafter_dir(), embed_tokens=model.embed_tokens, lm_head=model.lm_head,
                        target_hidden_size=cfg.hidden_size, target_num_layers=cfg.num_hidden_layers,
                        target_vocab_size=cfg.vocab_size, device=device, dtype=dtype or model.embed_tokens.weight.dtype)
