"""Load a target (HF safetensors folder or GGUF file) into our TargetModel, plus its tokenizer.

GGUF files are dequantised once by transformers (``gguf_file=``) and written as an HF folder
(config.json, model.safetensors in fp32 with transformers' tensor names, tokenizer files) under
``$DDTREE_CACHE/<sha256[:16]>/`` (default ``~/.cache/ddtree-server``); later loads read that folder.

Family detection: llama / mistral / qwen2 / qwen3 run on our TargetModel; Qwen3.5 / Qwen3.6
hybrids (``qwen3_5``, ``qwen3_5_text``: Gated DeltaNet + gated attention, text-only or multimodal
folder) run on our HybridTarget (models/hybrid/); both verify trees. Other hybrid / recurrent
architectures (incl. the MoE ``qwen3_5_moe``) and any other model_type are served by ``HFRunner``
(plain decoding through transformers' model) with ``tree_mode_available=False``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddtree_server.models.default import sha256_file
from ddtree_server.models.hf_runner import HFRunner
from ddtree_server.models.random_init import as_config, target_from_config  # noqa: F401 (bench --random-shape)
from ddtree_server.models.target import TREE_FAMILIES, TargetModel

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_HYBRID_TYPES = ("qwen3_5", "qwen3_next", "mamba", "jamba", "falcon_h1", "zamba", "bamba",
                 "nemotron_h", "granitemoehybrid", "lfm2", "recurrent_gemma", "rwkv", "xlstm", "minimax")
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}


class TargetLoadError(RuntimeError):
    """The target folder/file is missing, incomplete or inconsistent (message names the problem)."""


@dataclass
class LoadedTarget:
    """What ``load_target`` returns."""

    model: TargetModel | HFRunner
    tokenizer: object
    config: object
    tree_mode_available: bool
    message: str                 # one start-up line: family and mode availability
    folder: Path                 # HF folder actually read (the cache folder for GGUF)
    eos_token_ids: list[int] = field(default_factory=list)
    max_position_embeddings: int | None = None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32"|"bf16"|"fp16"`` (or torch names / dtypes) -> torch.dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16") from None


def _attr(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def detect_family(config) -> tuple[bool, str]:
    """(tree_capable, start-up message) for a transformers config (or its config.json dict)."""
    from ddtree_server.models.hybrid.config import hybrid_model_type

    mt = str(_attr(config, "model_type", "?"))
    if hybrid_model_type(config):
        return True, (f"target {mt}: hybrid Gated DeltaNet + gated attention (our HybridTarget), "
                      "tree mode available")
    layer_types = set(_attr(config, "layer_types", None) or [])
    if mt.startswith(_HYBRID_TYPES) or (layer_types - _ATTENTION_LAYER_TYPES):
        return False, (f"target {mt} is a hybrid/recurrent architecture: tree mode unavailable, "
                       "serving with plain autoregressive decoding (transformers model)")
    if mt not in TREE_FAMILIES:
        return False, (f"target {mt} is not one of {', '.join(TREE_FAMILIES)}: tree mode unavailable, "
                       "serving with plain autoregressive decoding (transformers model)")
    return True, f"target {mt}: tree mode available"


def cache_root() -> Path:
    """``$DDTREE_CACHE`` or ``~/.cache/ddtree-server``."""
    env = os.environ.get("DDTREE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddtree-server"


def _complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def gguf_to_folder(gguf: Path, sha256: str | None = None) -> Path:
    """Dequantise ``gguf`` once into an HF folder under the cache; return that folder.

    The folder is written to a temporary sibling and renamed into place, so a crashed conversion
    never leaves a half-written cache. Raises TargetLoadError if the file does not exist.
    """
    gguf = Path(gguf)
    if not gguf.is_file():
        raise TargetLoadError(f"GGUF file {gguf} does not exist")
    digest = sha256 or sha256_file(gguf)
    folder = cache_root() / digest[:16]
    if _complete(folder):
        return folder
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantising %s into %s (first load only)", gguf, folder)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=folder.parent))
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt", "source_sha256": digest})
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        if folder.exists() and not _complete(folder):
            shutil.rmtree(folder)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not _complete(folder):  # another process won the race with a complete folder: fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


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


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
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


def _eos_ids(folder: Path, config, tokenizer) -> list[int]:
    ids: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    gen = folder / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return ids


def load_target(folder: str | Path | None = None, *, gguf: str | Path | None = None,
                gguf_sha256: str | None = None, device: str = "cpu", dtype: str | torch.dtype = "fp32"
                ) -> LoadedTarget:
    """Load a target from an HF folder or a GGUF file (exactly one of them).

    Args:
        folder: HF folder with config.json, (sharded) safetensors and tokenizer files.
        gguf: a GGUF file; converted once into the cache (see ``gguf_to_folder``).
        gguf_sha256: the file's known sha256 (skips re-hashing).
        device: ``"cpu"`` / ``"cuda"`` / ``"cuda:N"``.
        dtype: ``fp32`` / ``bf16`` / ``fp16``.
    Raises:
        TargetLoadError: bad arguments or an incomplete folder. ValueError: unknown dtype.
    """
    if (folder is None) == (gguf is None):
        raise TargetLoadError("give exactly one of a target folder or a GGUF file")
    torch_dtype = resolve_dtype(dtype)
    src = gguf_to_folder(Path(gguf), gguf_sha256) if gguf is not None else Path(folder)
    if not (src / "config.json").is_file():
        raise TargetLoadError(f"{src} has no config.json")
    try:
        raw = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetLoadError(f"{src / 'config.json'}: not readable JSON ({exc})") from None
    from ddtree_server.models.hybrid.config import hybrid_model_type

    if isinstance(raw, dict) and hybrid_model_type(raw):
        from ddtree_server.models.hybrid.load import load_hybrid_folder

        return load_hybrid_folder(src, raw, torch_dtype, torch.device(device))
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(src)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tree_ok, message = detect_family(config)
    if tree_ok:
        model = build_target(config, _read_state(src), torch_dtype, torch.device(device))
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype).to(device)
        model = HFRunner(hf)
    log.info("%s", message)
    return LoadedTarget(model=model, tokenizer=tokenizer, config=config, tree_mode_available=tree_ok,
                        message=message, folder=src, eos_token_ids=_eos_ids(src, config, tokenizer),
                        max_position_embeddings=getattr(config, "max_position_embeddings", None))

