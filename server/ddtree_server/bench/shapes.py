"""Named model shapes for the random-weight benchmark (`bench --random-shape NAME`).

A shape is a target config (a raw transformers ``config.json`` dict: any family
``models.random_init.target_from_config`` can build, so a hybrid shape is one more row) plus the z-lab
DFlash drafter config that goes with it. Only sizes matter: weights are random, no tokenizer is read.

Sources of the rows:
* ``qwen3-8b``: the published Qwen/Qwen3-8B ``config.json`` (huggingface.co/Qwen/Qwen3-8B);
  drafter: z-lab/Qwen3-8B-DFlash-b16 (huggingface.co/z-lab/Qwen3-8B-DFlash-b16), whose sizes,
  block size, mask id and target layer ids are reproduced in vllm-project/speculators,
  ``tests/unit/convert/test_dflash_converter.py`` (``_source_config``). Its RoPE / eps settings are
  not in that excerpt; the target's (theta 1e6, eps 1e-6) are used, which do not change timing.
* ``smollm2-135m``: the embedded default (HuggingFaceTB/SmolLM2-135M-Instruct config) and the
  shipped drafter ``ddtree_server/assets/drafter/config.json``.
* ``llama-3.1-8b``: the published meta-llama/Llama-3.1-8B-Instruct ``config.json``. Its DFlash
  drafter (z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat) config was not checked: the row assumes
  the Qwen3-8B drafter's layout (5 layers, block 16) at Llama's sizes, layer ids by the reference
  default rule; treat its drafter numbers as an estimate.
* ``qwen3.6-27b``: the fleet's hybrid target (Qwen/Qwen3.6-27B config.json, text part) and the
  z-lab/Qwen3.6-27B-DFlash drafter, as reproduced with their sources in models/hybrid/shapes.py.
* ``tiny`` and ``tiny-hybrid``: toys for the CPU tests.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree_server.models.hybrid.shapes import published

_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "drafter" / "config.json"


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: raw target and drafter config dicts, and where they come from."""

    name: str
    target: dict[str, Any]
    drafter: dict[str, Any] | None
    source: str


def _drafter(n_layers: int, target_layers: int, layer_ids: list[int], mask_id: int, t: dict,
             block: int = 16) -> dict[str, Any]:
    """A z-lab DFlash config dict at the target's sizes (hidden, heads, vocab, rope)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
        "dflash_config": {"block_size": block, "mask_token_id": mask_id, "target_layer_ids": layer_ids},
        "num_target_layers": target_layers, "num_hidden_layers": n_layers,
        "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "hidden_act": "silu", "rms_norm_eps": t["rms_norm_eps"], "vocab_size": t["vocab_size"],
        "max_position_embeddings": t["max_position_embeddings"], "rope_theta": t["rope_theta"],
        "tie_word_embeddings": t.get("tie_word_embeddings", False),
    }


_QWEN3_8B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
}
_SMOLLM2_135M = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "attention_bias": False, "hidden_act": "silu",
}
_LLAMA_31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32,
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "attention_bias": False, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
_TINY = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 300, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "attention_bias": False, "hidden_act": "silu",
}


_TINY_HYBRID = {
    "model_type": "qwen3_5_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
}


def _shipped_drafter() -> dict[str, Any] | None:
    return json.loads(_ASSETS.read_text()) if _ASSETS.is_file() else None


def _table() -> dict[str, Shape]:
    return {
        "qwen3-8b": Shape("qwen3-8b", _QWEN3_8B, _drafter(5, 36, [1, 9, 17, 25, 33], 151669, _QWEN3_8B),
                          "Qwen/Qwen3-8B config.json; drafter z-lab/Qwen3-8B-DFlash-b16 (5 layers, block 16)"),
        "smollm2-135m": Shape("smollm2-135m", _SMOLLM2_135M, _shipped_drafter(),
                              "SmolLM2-135M-Instruct config; drafter: the shipped assets/drafter/config.json"),
        "llama-3.1-8b": Shape("llama-3.1-8b", _LLAMA_31_8B, _drafter(5, 32, [1, 8, 15, 22, 29], 128002, _LLAMA_31_8B),
                              "Llama-3.1-8B-Instruct config.json; drafter layout ASSUMED (Qwen3-8B drafter's)"),
        "tiny": Shape("tiny", _TINY, _drafter(1, 2, [0, 1], 299, _TINY, block=4), "2-layer toy for CPU tests"),
        "qwen3.6-27b": Shape("qwen3.6-27b", *published("qwen3.6-27b"),
                             "Qwen/Qwen3.6-27B config.json (48 Gated DeltaNet + 16 gated attention layers); drafter "
                             "z-lab/Qwen3.6-27B-DFlash (4 sliding-window + 1 full layer, block 16); "
                             "models/hybrid/shapes.py"),
        "tiny-hybrid": Shape("tiny-hybrid", _TINY_HYBRID, _drafter(1, 4, [0, 3], 299, _TINY_HYBRID, block=4),
                             "4-layer Qwen3.5-style toy (3 GDN + 1 attention) for CPU tests"),
    }


SHAPE_NAMES = tuple(_table())


def get_shape(name: str) -> Shape:
    """The named shape (deep copies of its dicts). Raises KeyError naming the known shapes."""
    table = _table()
    if name not in table:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(table)}")
    s = table[name]
    return Shape(s.name, copy.deepcopy(s.target), copy.deepcopy(s.drafter), s.source)


def shape_from_dicts(name: str, target: dict[str, Any], drafter: dict[str, Any] | None = None,
                     source: str = "given") -> Shape:
    """A shape from raw config dicts (e.g. a hybrid target's config.json), not in the table."""
    return Shape(name, copy.deepcopy(target), copy.deepcopy(drafter), source)
