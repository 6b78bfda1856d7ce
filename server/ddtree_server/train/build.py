"""A new DFlash drafter for a given target: its DrafterConfig, initial weights and size.

The drafter takes the target's widths (hidden size, heads, head_dim, vocabulary) because it reuses
the target's embedding and LM head (docs/ddtree.md §1.1, §1.2). Its RoPE settings are copied from
the target once, at creation, and stored in the drafter's own config.json (loading never reads the
target's).
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.load import load_drafter
from ddtree_server.train.features import decoder_of

INIT_MODES = ("random", "target-first", "target-last")


def _rope_of(target_cfg) -> dict:
    params = getattr(target_cfg, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        # draft layers rotate the whole head: drop a hybrid target's partial / multimodal RoPE keys
        return {k: v for k, v in params.items() if k not in ("partial_rotary_factor", "mrope_section",
                                                             "mrope_interleaved")}
    out = dict(getattr(target_cfg, "rope_scaling", None) or {})
    out["rope_theta"] = float(getattr(target_cfg, "rope_theta", 10000.0))
    out.setdefault("rope_type", out.pop("type", "default"))
    return out


def new_drafter_config(target_cfg, *, num_layers: int, layer_ids: list[int], block_size: int,
                       mask_token_id: int, intermediate_size: int | None = None) -> DrafterConfig:
    """DrafterConfig for a fresh drafter of `num_layers` layers on top of a transformers target config.
    Raises DrafterConfigError for invalid choices (layer ids >= target depth, mask id outside vocab...)."""
    heads = target_cfg.num_attention_heads
    doc = {
        "architectures": ["DFlashDraftModel"],
        "model_type": target_cfg.model_type,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
        "num_target_layers": target_cfg.num_hidden_layers,
        "num_hidden_layers": num_layers,
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": intermediate_size or target_cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(target_cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // heads,
        "hidden_act": getattr(target_cfg, "hidden_act", "silu"),
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "vocab_size": target_cfg.vocab_size,
        "attention_bias": False,
        "max_position_embeddings": getattr(target_cfg, "max_position_embeddings", 32768),
        "tie_word_embeddings": bool(getattr(target_cfg, "tie_word_embeddings", False)),
        "rope_parameters": _rope_of(target_cfg),
    }
    return DrafterConfig.from_dict(doc, source="new drafter")


@torch.no_grad()
def init_drafter(drafter: DFlashDrafter, target: nn.Module | None, mode: str, seed: int = 0) -> None:
    """Initialise drafter weights in place.

    random: Linear weights ~ N(0, 0.02), biases 0, norm weights 1 (the first loss is high, ~50-80
    nats, because the untrained block rows are close to token embeddings that the tied LM head
    scores highly; it falls below 7 within ~100 steps).
    target-first / target-last: as random, then every draft layer i takes the same-named tensors of
    target decoder layer i (first) or T-L+i (last) when shapes match (q/k norms stay 1), and `norm`
    takes the target's final norm.
    Raises ValueError for an unknown mode or a target-* mode without a target."""
    if mode not in INIT_MODES:
        raise ValueError(f"init mode {mode!r}; choose one of {INIT_MODES}")
    g = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    if mode == "random":
        return
    if target is None:
        raise ValueError(f"init mode {mode} needs the target model")
    dec = decoder_of(target)
    if getattr(dec, "zero_centered_norms", False):
        raise ValueError(f"init mode {mode} is not available for this target (zero-centred norms, fused "
                         "projections: its layers do not map onto draft layers); use --init random")
    norm = getattr(dec, "norm", None)
    if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.weight.float())
    n_t, n_d = len(dec.layers), len(drafter.layers)
    offset = 0 if mode == "target-first" else n_t - n_d
    for i, layer in enumerate(drafter.layers):
        src = dict(dec.layers[offset + i].named_parameters())
        for name, p in layer.named_parameters():
            if name in src and src[name].shape == p.shape:
                p.copy_(src[name].float())


@torch.no_grad()
def load_weights(drafter: DFlashDrafter, folder, target: nn.Module) -> None:
    """Copy the weights of the z-lab drafter in `folder` into `drafter` (fp32), e.g. to continue
    training the shipped drafter on new data. Raises ValueError when its config differs from
    `drafter.config`, and the loader's errors for a bad folder."""
    cfg = target.config
    src = load_drafter(folder, embed_tokens=drafter.embed_tokens, lm_head=drafter.lm_head,
                       target_hidden_size=cfg.hidden_size, target_num_layers=cfg.num_hidden_layers,
                       target_vocab_size=cfg.vocab_size, dtype=torch.float32)
    if src.config != drafter.config:
        raise ValueError(f"{folder}: drafter config differs from the requested one "
                         "(layers, target layer ids, block size, mask id, sizes must match)")
    drafter.load_state_dict(src.state_dict(), strict=True)


def drafter_bytes(drafter: DFlashDrafter, bytes_per_param: int = 2) -> int:
    """Size of the drafter's tensors on disk at `bytes_per_param` (2 = bf16), header excluded."""
    return sum(p.numel() for p in drafter.state_dict().values()) * bytes_per_param
