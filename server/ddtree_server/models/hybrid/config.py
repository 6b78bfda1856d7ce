"""HybridConfig: the settings of a Qwen3.5 / Qwen3.6 hybrid target, parsed from its config.json.

Two published layouts (transformers' ``models/qwen3_5/configuration_qwen3_5.py``):
* text-only ``Qwen3_5ForCausalLM``: ``model_type`` ``qwen3_5_text``, keys at the top level;
* multimodal ``Qwen3_5ForConditionalGeneration`` (the released Qwen3.5-27B / Qwen3.6-27B
  folders): ``model_type`` ``qwen3_5``, the language model's keys under ``text_config`` and its
  weights under ``model.language_model.``; the vision tower (``vision_config``) is ignored.

Parsing works from the raw JSON (or any config object with the same attributes), so the server
does not need a transformers release that knows ``qwen3_5`` (the GPU machine's 5.17 may not).
Layer pattern: ``layer_types`` (``linear_attention`` = Gated DeltaNet, ``full_attention`` =
gated attention), else ``full_attention_interval`` (default 4: every 4th layer is attention).
Every problem raises ``HybridConfigError`` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HYBRID_TYPES = ("qwen3_5", "qwen3_5_text")
GDN, ATTN = "linear_attention", "full_attention"


class HybridConfigError(ValueError):
    """A hybrid config.json is unusable; the message names the key."""


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def hybrid_model_type(raw: Any) -> str | None:
    """The hybrid model_type of a config (dict or object) that our HybridTarget runs, else None."""
    mt = str(_get(raw, "model_type", "") or "")
    return mt if mt in HYBRID_TYPES else None


@dataclass(frozen=True)
class HybridConfig:
    """Validated Qwen3.5-family text settings (sizes in elements, positions in tokens)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_id: Any = None
    multimodal: bool = False           # weights under model.language_model. (ConditionalGeneration)
    model_type: str = "qwen3_5_text"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # ---- derived sizes used by the modules and the docs
    @property
    def rotary_dim(self) -> int:
        """RoPE width per head: ``int(head_dim * partial_rotary_factor)`` (64 for Qwen3.6-27B)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == GDN]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTN]

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k (key heads) and v (value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rope_parameters(self) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor}

    @classmethod
    def from_any(cls, raw: Any) -> "HybridConfig":
        """Parse a config.json dict, a transformers ``Qwen3_5Config`` / ``Qwen3_5TextConfig``, or
        another HybridConfig. Raises HybridConfigError (unknown model_type, missing or bad key)."""
        if isinstance(raw, HybridConfig):
            return raw
        mt = hybrid_model_type(raw)
        if mt is None:
            raise HybridConfigError(f"model_type {_get(raw, 'model_type')!r} is not one of {HYBRID_TYPES}")
        text = _get(raw, "text_config") if mt == "qwen3_5" else raw
        if text is None:
            raise HybridConfigError("model_type qwen3_5 needs a 'text_config'")
        return _parse(text, multimodal=mt == "qwen3_5", top=raw)


def _parse(t: Any, multimodal: bool, top: Any) -> HybridConfig:
    def num(key, kind=int, default=..., minimum=None):
        v = _get(t, key, None)
        if v is None:
            if default is ...:
                raise HybridConfigError(f"key '{key}' missing")
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and int(v) != v):
            raise HybridConfigError(f"key '{key}' must be a {kind.__name__}, got {v!r}")
        if minimum is not None and v < minimum:
            raise HybridConfigError(f"key '{key}' must be >= {minimum}, got {v}")
        return kind(v)

    layers = num("num_hidden_layers", minimum=1)
    types = _get(t, "layer_types", None)
    if types is None:
        every = num("full_attention_interval", default=4, minimum=1)
        types = [ATTN if (i + 1) % every == 0 else GDN for i in range(layers)]
    types = tuple(str(x) for x in types)
    if len(types) != layers or set(types) - {GDN, ATTN}:
        raise HybridConfigError(f"key 'layer_types' must list {layers} of {GDN!r}/{ATTN!r}, got {list(types)}")
    heads, kv = num("num_attention_heads", minimum=1), num("num_key_value_heads", minimum=1)
    hk, hv = num("linear_num_key_heads", minimum=1), num("linear_num_value_heads", minimum=1)
    if heads % kv:
        raise HybridConfigError(f"key 'num_key_value_heads' {kv} does not divide {heads} heads")
    if hv % hk:
        raise HybridConfigError(f"key 'linear_num_value_heads' {hv} is not a multiple of {hk} key heads")
    rope = dict(_get(t, "rope_parameters", None) or _get(t, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HybridConfigError(f"key 'rope_parameters.rope_type' {rope_type!r} is not supported (default only)")
    if _get(t, "attn_output_gate", True) is False:
        raise HybridConfigError("key 'attn_output_gate' false is not supported (Qwen3.5 attention is gated)")
    if _get(t, "hidden_act", "silu") not in ("silu", "swish"):
        raise HybridConfigError(f"key 'hidden_act' {_get(t, 'hidden_act')!r} is not supported (silu only)")
    theta = rope.get("rope_theta", _get(t, "rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", _get(t, "partial_rotary_factor", 0.25))
    eos = _get(t, "eos_token_id", None)
    return HybridConfig(
        vocab_size=num("vocab_size", minimum=1), hidden_size=num("hidden_size", minimum=1),
        intermediate_size=num("intermediate_size", minimum=1), num_hidden_layers=layers, layer_types=types,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=num("head_dim", minimum=2),
        linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_key_head_dim=num("linear_key_head_dim", minimum=1),
        linear_value_head_dim=num("linear_value_head_dim", minimum=1),
        linear_conv_kernel_dim=num("linear_conv_kernel_dim", default=4, minimum=1),
        rms_norm_eps=num("rms_norm_eps", float, default=1e-6), rope_theta=float(theta),
        partial_rotary_factor=float(partial),
        max_position_embeddings=num("max_position_embeddings", default=32768, minimum=1),
        tie_word_embeddings=bool(_get(top, "tie_word_embeddings", _get(t, "tie_word_embeddings", False))),
        attention_bias=bool(_get(t, "attention_bias", False)), hidden_act="silu",
        eos_token_id=eos if eos is not None else _get(top, "eos_token_id", None),
        multimodal=multimodal, model_type="qwen3_5" if multimodal else "qwen3_5_text")
