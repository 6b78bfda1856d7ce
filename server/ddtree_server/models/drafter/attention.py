"""Attention layout of DFlash draft layers: which keys each draft layer's queries may see.

z-lab's reference ``dflash/model.py`` (``Qwen3DFlashAttention``, ``_attention_mask``): a
``full_attention`` layer is non-causal over context and block; a ``sliding_attention`` layer is
causal and hides keys ``sliding_window`` or more positions before the query; a top-level
``is_causal`` overrides the causality of every layer. The z-lab Qwen3.6-27B drafter has 4 sliding
layers (window 2048) then 1 full layer; older drafters are all full attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddtree_server.models.drafter.errors import DrafterConfigError

if TYPE_CHECKING:
    from torch import Tensor


def _error(source: str, key: str, problem: str) -> DrafterConfigError:
    return DrafterConfigError(source, key, problem)


def attention_layout(raw: dict[str, Any], dflash: dict[str, Any], source: str, n_layers: int
                     ) -> tuple[tuple[str, ...], int | None, bool | None]:
    """(layer_types, sliding_window, is_causal) of a config; errors name the key."""
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        value = dflash.get(key, raw.get(key))
        if value is not None and value != neutral and not (neutral is None and not value):
            raise _error(source, f"dflash_config.{key}", f"{value!r} is not supported (DFlash v1 only)")
    types = raw.get("layer_types")
    if not types:
        return (), None, None
    if not isinstance(types, list) or len(types) != n_layers or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise _error(source, "layer_types", f"must list {n_layers} of full_attention / sliding_attention, "
                     f"got {types!r}")
    window = raw.get("sliding_window")
    if "sliding_attention" in types:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise _error(source, "sliding_window", f"sliding layers need a window >= 1, got {window!r}")
    else:
        window = None
    causal = raw.get("is_causal")
    if causal is not None and not isinstance(causal, bool):
        raise _error(source, "is_causal", f"must be true or false, got {causal!r}")
    if set(types) == {"full_attention"} and causal is None:
        return (), None, None
    return tuple(types), window, causal


def visibility(q_pos: Tensor, k_pos: Tensor, kind: tuple[bool, int | None]) -> Tensor | None:
    """Bool ``[..., Tq, Tk]`` (True = see) of a draft layer of ``kind`` = (causal, window) for
    query / key positions ``[..., Tq]`` / ``[..., Tk]``; None when every key is visible (full,
    non-causal layers). Rule of z-lab ``dflash/model.py`` ``_attention_mask``: causal hides
    later keys; a window W hides keys W or more positions before the query (and, non-causal,
    after it)."""
    import torch

    causal, window = kind
    if not causal and window is None:
        return None
    d = q_pos[..., :, None] - k_pos[..., None, :]
    see = d >= 0 if causal else torch.ones_like(d, dtype=torch.bool)
    if window is not None:
        see = see & (d < window)
        if not causal:
            see = see & (-d < window)
    return see
