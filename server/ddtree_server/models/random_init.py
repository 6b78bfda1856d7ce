"""Targets of a published shape with random weights, built quickly on any device (benchmarks).

``target_from_config(config, device=..., dtype=...)`` builds our target for any family with a
builder in models/families.py (dense ``TargetModel`` or Qwen3.5 ``HybridTarget``) from a
transformers config or its config.json dict (or, for hybrids, a HybridConfig): the module is
created on the ``meta`` device with the requested default dtype, materialised directly on
``device`` (``to_empty``: no host copy, no fp32 detour; a 27B model in bf16 needs 55 GB, not 110)
and filled in place with a small-std normal init, so logits are finite and every kernel does its
real work.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ddtree_server.models import families
from ddtree_server.models.common import resolve_dtype

STD = 0.02


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def target_from_config(config, *, device: str | torch.device = "cpu", dtype: str | torch.dtype = "bf16",
                       seed: int = 0, method: str | None = None) -> nn.Module:
    """Our target (eval mode, no grad) for ``config`` with random weights on ``device``.

    config: a transformers config of a dense family (llama / mistral / qwen2 / qwen3) or of
    ``qwen3_5`` / ``qwen3_5_text`` (also a config.json dict or HybridConfig). method: GDN tree
    method of a hybrid (default: HybridTarget's). Raises ValueError for another model_type.
    Init: linear / embedding weights N(0, 0.02^2), biases 0, RMSNorm weights 1 (zero-centred
    ones 0), GDN ``A_log = log(U(1, 16))`` and ``dt_bias = 1`` (fp32), conv weights N(0, 1/K)."""
    dtype, device = resolve_dtype(dtype), torch.device(device)
    family = families.family_of(config)
    if family.build is None:
        raise ValueError(f"no target for model_type {families.model_type(config)!r}; "
                         f"supported: {', '.join(families.buildable_types())}")
    with torch.device("meta"), _default_dtype(dtype):
        model = family.build(config, method)
    model = model.to_empty(device=device)
    _init(model, seed, device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def _init(model: nn.Module, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    zero_centred = getattr(model, "zero_centered_norms", False)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data = torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            p.data = torch.ones(p.shape, device=device)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        elif name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif name.endswith("norm.weight"):
            p.fill_(0.0 if zero_centred else 1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, STD, generator=gen)


def drafter_from_config(config, target: nn.Module, *, device: str | torch.device = "cpu",
                        dtype: str | torch.dtype = "bf16", seed: int = 0) -> nn.Module:
    """A DFlashDrafter of a z-lab config (dict, e.g. ``hybrid.shapes.published(name)[1]``, or a
    DrafterConfig) bound to ``target``'s embedding and LM head, random weights on ``device``
    (N(0, 0.02^2), norms 1). Raises DrafterConfigError for a bad config."""
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.model import DFlashDrafter

    cfg = config if isinstance(config, DrafterConfig) else DrafterConfig.from_dict(dict(config), source="random drafter")
    dtype, device = resolve_dtype(dtype), torch.device(device)
    with torch.device("meta"), _default_dtype(dtype):
        drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    drafter = drafter.to_empty(device=device)
    _init(drafter, seed, device)
    return drafter.eval().requires_grad_(False)
