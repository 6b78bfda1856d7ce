"""What every family's loader shares: the result (``LoadedTarget``), the load error, dtype names and
the EOS ids of a folder. No family code here, so every loader can import it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    """The target folder/file is missing, incomplete or inconsistent (message names the problem)."""


@dataclass
class LoadedTarget:
    """What ``load_target`` returns."""

    model: Any                   # TargetModel / HybridTarget / HFRunner (models/families.py)
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


def eos_ids(folder: Path, config, tokenizer) -> list[int]:
    """EOS ids of a target, in order and without repeats: the tokenizer's, the config's, then
    ``generation_config.json``'s."""
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
