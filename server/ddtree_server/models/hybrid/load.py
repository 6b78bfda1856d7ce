"""Load a Qwen3.5 / Qwen3.6 checkpoint folder into a HybridTarget, reading only the language model.

Tensor names (transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5ForConditionalGeneration``):
text-only folders hold ``model.layers.*``, ``model.embed_tokens``, ``model.norm``, ``lm_head``;
multimodal folders hold the same under ``model.language_model.`` next to ``model.visual.*``
(the vision tower) and ``mtp.*`` (the multi-token-prediction head). The safetensors index (or
the single file's header) says where each tensor is; only the language model's tensors are read
(``safe_open(...).get_tensor`` per name), so the vision tower and MTP head are never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_server.models.common import LoadedTarget, TargetLoadError, eos_ids
from ddtree_server.models.hybrid.config import GDN, HybridConfig, HybridConfigError
from ddtree_server.models.hybrid.model import DEFAULT_METHOD, HybridTarget

_FUSED = {  # our fused tensor <- checkpoint parts, concatenated along the output axis
    "linear_attn.in_proj.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                   "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_FP32 = ("linear_attn.A_log", "linear_attn.dt_bias")  # kept in fp32 whatever the model dtype


def language_prefix(cfg: HybridConfig) -> str:
    return "model.language_model." if cfg.multimodal else "model."


def weight_index(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (index file or the single file's header)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors (or index)")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def read_language_model(folder: str | Path, cfg: HybridConfig) -> dict[str, torch.Tensor]:
    """The language model's tensors of ``folder``, names without the prefix (``layers.0...``,
    ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``); other tensors are not read."""
    from safetensors import safe_open

    folder = Path(folder)
    prefix = language_prefix(cfg)
    where = weight_index(folder)
    wanted: dict[Path, list[str]] = {}
    for name, file in where.items():
        if name.startswith(prefix) or name == "lm_head.weight":
            wanted.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in wanted.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                out[name[len(prefix):] if name.startswith(prefix) else name] = f.get_tensor(name)
    return out


def fuse_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> HybridTarget names (fused projections); incomplete groups stay as they
    are so that the strict check names them."""
    out = dict(state)
    for key in [k for k in out if k.startswith("layers.")]:
        for fused, parts in _FUSED.items():
            if key.endswith("." + parts[0]):
                base = key[: -len(parts[0])]
                names = [base + p for p in parts]
                if all(n in out for n in names):
                    out[base + fused] = torch.cat([out.pop(n) for n in names], dim=0)
    return {k: v for k, v in out.items() if not k.endswith("rotary_emb.inv_freq")}


def build_hybrid(cfg: HybridConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device,
                 method: str = DEFAULT_METHOD) -> HybridTarget:
    """HybridTarget from prefix-free checkpoint tensors (``read_language_model``).

    Raises ValueError naming missing / unexpected tensors or a shape mismatch."""
    with torch.device("meta"):
        model = HybridTarget(cfg, method)
    mapped = fuse_state(state)
    if cfg.tie_word_embeddings:
        mapped["lm_head.weight"] = mapped.get("embed_tokens.weight")
    expected = model.state_dict()
    missing = sorted(k for k in expected if mapped.get(k) is None)
    unexpected = sorted(k for k in mapped if k not in expected)
    if missing or unexpected:
        raise ValueError(f"weights do not match {cfg.model_type}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    loaded = {}
    for k, ref in expected.items():
        if tuple(mapped[k].shape) != tuple(ref.shape):
            raise ValueError(f"tensor {k} has shape {tuple(mapped[k].shape)}, expected {tuple(ref.shape)}")
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        loaded[k] = mapped[k].to(device=device, dtype=torch.float32 if k.endswith(_FP32) else dtype)
    if cfg.tie_word_embeddings:
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    model.load_state_dict(loaded, strict=True, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def count_layers(cfg: HybridConfig) -> str:
    gdn = sum(t == GDN for t in cfg.layer_types)
    return f"{gdn} Gated DeltaNet + {cfg.num_hidden_layers - gdn} gated attention layers"


def load_hybrid_folder(src: Path, raw: dict, dtype: torch.dtype, device: torch.device, message: str) -> LoadedTarget:
    """``models.load.load_target`` for a Qwen3.5 / Qwen3.6 folder (text-only or multimodal): our
    HybridTarget, the config parsed from config.json (no transformers class needed), only the
    language model's tensors read. ``message``: the family's start-up line, completed here with the
    layer counts and the GDN tree method. Returns a LoadedTarget; raises TargetLoadError."""
    from transformers import AutoTokenizer

    try:
        cfg = HybridConfig.from_any(raw)
        model = build_hybrid(cfg, read_language_model(src, cfg), dtype, device)
    except (HybridConfigError, ValueError, FileNotFoundError) as exc:
        raise TargetLoadError(f"{src}: {exc}") from None
    tokenizer = AutoTokenizer.from_pretrained(src)
    message = f"{message}; {count_layers(cfg)}, GDN tree method {model.method}"
    return LoadedTarget(model=model, tokenizer=tokenizer, config=cfg, tree_mode_available=True,
                        message=message, folder=src, eos_token_ids=eos_ids(src, cfg, tokenizer),
                        max_position_embeddings=cfg.max_position_embeddings)
