"""Load a dense (Llama / Mistral / Qwen2 / Qwen3) HF folder into our TargetModel.

transformers' tensor names are mapped to ours (``fuse_hf_state``: q|k|v and gate|up fused); the
load is strict (missing, unexpected or mis-shaped tensors raise TargetLoadError naming them).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_server.models.common import LoadedTarget, TargetLoadError, eos_ids
from ddtree_server.models.dense.target import TargetModel


def fuse_hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers Llama/Qwen state dict -> TargetModel names: drop ``model.``, concatenate
    ``q_proj|k_proj|v_proj`` into ``qkv_proj`` and ``gate_proj|up_proj`` into ``gate_up_proj``
    (weights and biases). Unrelated keys pass through unchanged; incomplete groups are left as is
    (the caller's strict load then names them)."""
    out = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    groups = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))
    for key in [k for k in out if k.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "gate_proj.bias"))]:
        for parts, fused in groups:
            if f".{parts[0]}." not in key:
                continue
            names = [key.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            if all(n in out for n in names):
                out[key.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s (sharded) safetensors; TargetLoadError when there are none."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise TargetLoadError(f"{folder} has no model.safetensors (or index)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def build_target(config, state: dict[str, torch.Tensor], dtype: torch.dtype, device) -> TargetModel:
    """Our TargetModel from transformers-named tensors (``model.`` prefix optional).

    Raises TargetLoadError naming missing / unexpected tensors or shape mismatches.
    """
    with torch.device("meta"):
        model = TargetModel(config)
    mapped = {k: v for k, v in fuse_hf_state(state).items() if not k.endswith("rotary_emb.inv_freq")}
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:
        mapped["lm_head.weight"] = mapped.get("embed_tokens.weight")
    expected = model.state_dict()
    missing = sorted(k for k in expected if mapped.get(k) is None)
    unexpected = sorted(k for k in mapped if k not in expected)
    if missing or unexpected:
        raise TargetLoadError(f"weights do not match {config.model_type}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for k, ref in expected.items():
        if tuple(mapped[k].shape) != tuple(ref.shape):
            raise TargetLoadError(f"tensor {k} has shape {tuple(mapped[k].shape)}, expected {tuple(ref.shape)}")
    converted = {}
    for k, v in mapped.items():
        if k == "lm_head.weight" and tied:
            continue
        converted[k] = v.to(device=device, dtype=dtype)
    if tied:
        converted["lm_head.weight"] = converted["embed_tokens.weight"]
    model.load_state_dict(converted, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def as_config(config):
    """A transformers config from a raw ``config.json`` dict of a dense family (``model_type``
    required), or the config itself. Raises ValueError for a dict without ``model_type``."""
    if not isinstance(config, dict):
        return config
    from transformers import AutoConfig

    raw = dict(config)
    model_type = raw.pop("model_type", None)
    if not model_type:
        raise ValueError("config dict has no model_type")
    return AutoConfig.for_model(model_type, **raw)


def load_dense_folder(src: Path, config, dtype: torch.dtype, device: torch.device, message: str) -> LoadedTarget:
    """``models.load.load_target`` for a dense family: ``config`` is transformers' config of ``src``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    model = build_target(config, read_state(src), dtype, device)
    return LoadedTarget(model=model, tokenizer=tokenizer, config=config, tree_mode_available=True,
                        message=message, folder=src, eos_token_ids=eos_ids(src, config, tokenizer),
                        max_position_embeddings=getattr(config, "max_position_embeddings", None))
