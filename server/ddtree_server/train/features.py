"""Context features from a frozen transformers target: outputs of chosen decoder layers via hooks.

docs/ddtree.md §1.4 (z-lab/dflash `extract_context_feature`): the drafter's context is the
concatenation (in list order) of the outputs of the target's decoder layers `target_layer_ids`
(0-based). Forward hooks on `decoder.layers[k]` are used instead of `output_hidden_states` (whose
selective form differs between transformers 5.17 and 5.24); this is also what our TargetModel's
`capture_layers` returns.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding `.layers`) of a transformers causal LM.
    Raises ValueError if none is found."""
    for cand in (getattr(model, "model", None), model):
        if cand is not None and isinstance(getattr(cand, "layers", None), nn.ModuleList):
            return cand
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    if dec is not None and isinstance(getattr(dec, "layers", None), nn.ModuleList):
        return dec
    raise ValueError(f"{type(model).__name__}: no decoder with a .layers ModuleList")


class _Enough(Exception):
    """Raised by the hook of the deepest requested layer: the layers above it are not needed."""


@torch.no_grad()
def capture_features(model: nn.Module, input_ids: Tensor, layer_ids: list[int] | tuple[int, ...]) -> Tensor:
    """Run the decoder on input_ids [B, T] (causal, right padding only) and return the outputs of
    `layer_ids` concatenated: [B, T, len(layer_ids) * hidden]. The forward stops after the deepest
    requested layer (the layers above it, the final norm and the LM head never run).
    Raises IndexError for a layer id beyond the decoder depth. A target that brings its own
    feature path (``target_features``, e.g. train/own_target.py for hybrids) uses it."""
    own = getattr(model, "target_features", None)
    if callable(own):
        return own(input_ids, list(layer_ids))
    dec = decoder_of(model)
    n = len(dec.layers)
    if max(layer_ids) >= n:
        raise IndexError(f"layer id {max(layer_ids)} >= target depth {n}")
    got: dict[int, Tensor] = {}
    last = max(layer_ids)

    def hook(k):
        def fn(_module, _args, out):
            got[k] = out[0] if isinstance(out, (tuple, list)) else out
            if k == last:
                raise _Enough
        return fn

    handles = [dec.layers[k].register_forward_hook(hook(k)) for k in set(layer_ids)]
    try:
        dec(input_ids=input_ids, use_cache=False)
    except Exception:  # noqa: BLE001 - our _Enough, possibly re-wrapped by a decorator
        if last not in got:
            raise
    finally:
        for h in handles:
            h.remove()
    return torch.cat([got[k] for k in layer_ids], dim=-1)
