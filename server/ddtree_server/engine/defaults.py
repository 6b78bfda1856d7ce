"""Sampling defaults of a model: what a request that omits temperature / top_p / top_k gets.

Like vLLM (`--generation-config auto`), the values come from the model folder's
`generation_config.json` (`temperature`, `top_p`, `top_k`); a key it lacks falls back to OpenAI's
default (temperature 1, top_p 1) and no top-k. The embedded SmolLM2 GGUF carries no generation
config, so it gets the sampling of its model card's usage example
(https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: `temperature=0.2, top_p=0.9`): at
OpenAI's temperature 1 this 135M model answers "What is the capital of France?" with noise.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EMBEDDED_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
KEYS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, None)}


def from_generation_config(folder: str | Path | None) -> dict[str, Any]:
    """The sampling keys of `folder/generation_config.json` that are valid numbers ({} when none)."""
    if folder is None:
        return {}
    path = Path(folder) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    found: dict[str, Any] = {}
    for key, (low, high) in KEYS.items():
        value = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if value < low or (high is not None and value > high) or (key == "top_p" and value == 0):
            log.warning("%s: ignoring %s=%r (out of range)", path, key, value)
            continue
        found[key] = int(value) if key == "top_k" else float(value)
    if found.get("top_k") == 0:
        del found["top_k"]   # transformers' "no top-k"
    return found


def sampling_defaults(folder: str | Path | None, embedded: bool) -> dict[str, Any]:
    """The defaults for a target loaded from `folder` (`embedded`: the built-in SmolLM2 GGUF)."""
    found = from_generation_config(folder)
    return {**EMBEDDED_DEFAULTS, **found} if embedded else found
