"""Published configs of the fleet's hybrid target and its z-lab DFlash drafters (no weights).

Used by the random-shape benchmarks (``bench.hybrid_verify``, ``target_from_config``) and by the
memory figures in docs/hybrid.md. Sources:

* Qwen3.6-27B (``Qwen/Qwen3.6-27B``, model card "Model Overview" and config.json; Qwen3.5-27B has
  the same language model shape, cf. THUDM/slime ``scripts/models/qwen3.5-27B.sh``): 64 layers as
  16 x (3 Gated DeltaNet + 1 gated attention), hidden 5120, MLP 17408, attention 24 Q / 4 KV heads
  of dim 256 with RoPE on 64 channels (partial factor 0.25, theta 1e7), GDN 16 QK / 48 V heads
  of dim 128, conv kernel 4, vocabulary 248320, untied LM head, 262144 positions. The released
  folder is multimodal (``Qwen3_5ForConditionalGeneration``, ``text_config``).
* z-lab/Qwen3.6-27B-DFlash config.json (as quoted by its GGUF conversions, e.g.
  spiritbuun/Qwen3.6-27B-DFlash-GGUF: "pattern [S,S,S,S,F], window = 2048"): 5 draft layers,
  4 ``sliding_attention`` (window 2048) + 1 ``full_attention``, hidden 5120, MLP 17408, 32 / 8
  heads of dim 128, block size 16, mask token 248070, target layers [1, 16, 31, 46, 61].
* z-lab/Qwen3.5-27B-DFlash: the same sizes, ids and mask token, all 5 layers full attention.
"""

from __future__ import annotations

import copy

QWEN36_27B_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "full_attention_interval": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "attention_bias": False,
    "hidden_act": "silu", "eos_token_id": 248044,
}

_DRAFTER_27B = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "num_target_layers": 64, "num_hidden_layers": 5, "hidden_size": 5120, "intermediate_size": 17408,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "vocab_size": 248320, "rope_theta": 10000000.0, "max_position_embeddings": 262144,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
}
QWEN36_27B_DRAFTER = {**_DRAFTER_27B, "sliding_window": 2048,
                      "layer_types": ["sliding_attention"] * 4 + ["full_attention"]}
QWEN35_27B_DRAFTER = {**_DRAFTER_27B, "layer_types": ["full_attention"] * 5}

SHAPES = {"qwen3.6-27b": (QWEN36_27B_TEXT, QWEN36_27B_DRAFTER),
          "qwen3.5-27b": (QWEN36_27B_TEXT, QWEN35_27B_DRAFTER)}


def published(name: str) -> tuple[dict, dict]:
    """(target text config, drafter config) dicts of a published shape (deep copies).
    Raises KeyError naming the known shapes."""
    if name not in SHAPES:
        raise KeyError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return tuple(copy.deepcopy(d) for d in SHAPES[name])
