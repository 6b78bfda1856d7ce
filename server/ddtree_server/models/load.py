"""Load a target (HF safetensors folder or GGUF file) into our TargetModel, plus its tokenizer.

GGUF files are dequantised once by transformers (``gguf_file=``) and written as an HF folder
(config.json, model.safetensors in fp32 with transformers' tensor names, tokenizer files) under
``$DDTREE_CACHE/<sha256[:16]>/`` (default ``~/.cache/ddtree-server``); later loads read that folder.

The folder's family (models/families.py) then loads it: llama / mistral / qwen2 / qwen3 on our
TargetModel, Qwen3.5 / Qwen3.6 hybrids on our HybridTarget (both verify trees); other hybrid /
recurrent architectures and any other model_type are served by ``HFRunner`` (plain decoding through
transformers' model) with ``tree_mode_available=False``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ddtree_server.models import families
from ddtree_server.models.common import LoadedTarget, TargetLoadError, resolve_dtype
from ddtree_server.models.default import sha256_file

log = logging.getLogger(__name__)


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
    config, family = raw, (families.family_of(raw) if isinstance(raw, dict) else None)
    if family is None or not family.own_config:  # decided on transformers' reading of the folder
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(src)
        family = families.family_of(config)
    message = family.describe(families.model_type(config))
    loaded = family.load(src, config, torch_dtype, torch.device(device), message)
    log.info("%s", loaded.message)
    return loaded
