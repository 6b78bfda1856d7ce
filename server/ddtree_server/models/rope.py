"""RoPE frequencies of a transformers config (default, llama3, yarn, linear, ... scaling)."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(config) -> tuple[Tensor, float]:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (fp32, CPU) and the attention scaling factor.

    Reads ``config.rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x).
    Non-default types go through ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``; dynamic
    types are evaluated once at the configured length (no per-length re-scaling).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    dim = int(head_dim * partial)
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float().cpu(), float(scaling)
