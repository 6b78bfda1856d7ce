"""DrafterConfig: the settings of a z-lab DFlash drafter, parsed from its `config.json`.

Source: the published z-lab drafters' config.json and z-lab/dflash `dflash/model.py`; summarised
in docs/ddtree.md §1.2 (config keys, default layer rule, RoPE pitfalls, other formats and
architectures to refuse). Every problem raises `DrafterConfigError` naming the file and the key.

Rules applied here:
* `architectures` must be `["DFlashDraftModel"]`; DFlash2 / DSpark / Domino and speculators-format
  checkpoints (`speculators_config`, `speculators_model_type`, `aux_hidden_state_layer_ids`) are refused.
* `block_size`: `dflash_config.block_size` first, then the top-level key.
* `mask_token_id`: `dflash_config.mask_token_id` (required, inside the vocabulary).
* `target_layer_ids`: `dflash_config.target_layer_ids`; when absent the operator must pass ids
  explicitly. The default rule of the reference code is only printed as a hint, never applied.
* RoPE: `rope_parameters` first, then top-level `rope_theta` / `rope_scaling`; never the target's.
* `layer_types`: `full_attention` (non-causal over context and block) or `sliding_attention`
  (causal, a key at distance >= `sliding_window` hidden), as z-lab's reference `dflash/model.py`
  (`Qwen3DFlashAttention`: a sliding layer is causal unless the config's `is_causal` says
  otherwise; the z-lab Qwen3.6-27B drafter has 4 sliding layers of window 2048 then 1 full layer).
* `dflash_config` scalings of other DFlash variants (`input_embedding_scale`, `output_multiplier`,
  `final_logit_softcapping`) are refused unless neutral.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_server.models.drafter.attention import attention_layout
from ddtree_server.models.drafter.errors import DrafterConfigError

ARCHITECTURE = "DFlashDraftModel"
_OTHER_ARCHS = ("DFlash2", "DSpark", "Domino")
_SPECULATORS_KEYS = ("speculators_config", "speculators_model_type", "aux_hidden_state_layer_ids",
                     "transformer_layer_config", "draft_vocab_size")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference code's default rule (z-lab/dflash `build_target_layer_ids`; docs/ddtree.md
    §1.2), for hints only.

    One draft layer -> [T//2]; otherwise L integers evenly spaced from 1 to T-3 inclusive.
    """
    t, n = num_target_layers, num_draft_layers
    if n == 1:
        return [t // 2]
    return [int(round(1 + i * (t - 4) / (n - 1))) for i in range(n)]


@dataclass(frozen=True)
class DrafterConfig:
    """Validated DFlash drafter settings (sizes in elements, positions in tokens)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    rope_parameters: dict[str, Any]
    attention_bias: bool = False
    hidden_act: str = "silu"
    model_type: str = "qwen3"
    num_target_layers: int | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()        # empty: all full_attention
    sliding_window: int | None = None
    is_causal: bool | None = None            # overrides the per-layer causality when set
    source: str = field(default="<dict>", compare=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def attention_kind(self, layer: int) -> tuple[bool, int | None]:
        """(causal, window) of draft layer ``layer``: full layers (False, None) by default,
        sliding layers (True, sliding_window); ``is_causal`` overrides the causality."""
        sliding = bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if sliding else None)

    @property
    def context_width(self) -> int:
        """Input width of `fc`: len(target_layer_ids) * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_file(cls, path: str | Path, target_layer_ids: list[int] | None = None) -> "DrafterConfig":
        """Parse `path` (a config.json, or a folder holding one); see `from_dict`."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DrafterConfigError(str(p), "config.json", "file not found") from None
        except json.JSONDecodeError as exc:
            raise DrafterConfigError(str(p), "config.json", f"not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise DrafterConfigError(str(p), "config.json", "top level is not a JSON object")
        return cls.from_dict(raw, source=str(p), target_layer_ids=target_layer_ids)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "<dict>",
                  target_layer_ids: list[int] | None = None) -> "DrafterConfig":
        """Validate a z-lab config dict.

        target_layer_ids: the operator's explicit ids; required when the config has none, and must
        agree with the config's when both exist. Raises DrafterConfigError.
        """
        r = _Reader(raw, source)
        r.check_architecture()
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DrafterConfigError(source, "dflash_config", "must be an object")
        n_layers = r.int("num_hidden_layers", minimum=1)
        hidden = r.int("hidden_size", minimum=1)
        heads = r.int("num_attention_heads", minimum=1)
        kv_heads = r.int("num_key_value_heads", minimum=1, default=heads)
        if heads % kv_heads:
            raise DrafterConfigError(source, "num_key_value_heads", f"{kv_heads} does not divide {heads} heads")
        vocab = r.int("vocab_size", minimum=1)
        num_target = r.int("num_target_layers", minimum=1, default=None)

        if "block_size" in dflash:
            block = _Reader(dflash, source, "dflash_config.").int("block_size", minimum=2)
        else:
            block = r.int("block_size", minimum=2)
        if "mask_token_id" not in dflash:
            raise DrafterConfigError(source, "dflash_config.mask_token_id", "missing")
        mask = _Reader(dflash, source, "dflash_config.").int("mask_token_id", minimum=0)
        if mask >= vocab:
            raise DrafterConfigError(source, "dflash_config.mask_token_id", f"{mask} >= vocab_size {vocab}")

        layer_ids = _layer_ids(dflash.get("target_layer_ids"), target_layer_ids, source, num_target, n_layers)
        layer_types, window, causal = attention_layout(raw, dflash, source, n_layers)
        return cls(
            block_size=block, mask_token_id=mask, target_layer_ids=tuple(layer_ids),
            num_hidden_layers=n_layers, hidden_size=hidden,
            intermediate_size=r.int("intermediate_size", minimum=1),
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=r.int("head_dim", minimum=1, default=hidden // heads),
            rms_norm_eps=r.float("rms_norm_eps"), vocab_size=vocab, rope_parameters=r.rope(),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=str(raw.get("hidden_act", "silu")), model_type=str(raw.get("model_type", "qwen3")),
            num_target_layers=num_target,
            max_position_embeddings=r.int("max_position_embeddings", minimum=1, default=32768),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), layer_types=layer_types,
            sliding_window=window, is_causal=causal, source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json document for this drafter (what `models/drafter/load.py`'s `save_drafter` writes)."""
        rope = dict(self.rope_parameters)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": self.model_type,
            "block_size": self.block_size,
            "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope,
            "rope_theta": rope["rope_theta"],
            "layer_types": list(self.layer_types or ["full_attention"] * self.num_hidden_layers),
            **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
            **({"is_causal": self.is_causal} if self.is_causal is not None else {}),
        }


def _layer_ids(found: Any, given: list[int] | None, source: str, num_target: int | None,
               n_layers: int) -> list[int]:
    key = "dflash_config.target_layer_ids"
    if found is None and given is None:
        hint = ""
        if num_target:
            hint = (f" (the reference default rule would give {default_layer_ids(num_target, n_layers)}"
                    " for this drafter; published drafters often differ, so check before using it)")
        raise DrafterConfigError(source, key, "missing; pass the target layer ids explicitly" + hint)
    ids = list(given if found is None else found)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DrafterConfigError(source, key, f"must be a non-empty list of non-negative ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise DrafterConfigError(source, key, f"repeated layer ids in {ids}")
    if found is not None and given is not None and list(given) != list(found):
        raise DrafterConfigError(source, key, f"config has {list(found)} but {list(given)} was requested")
    if num_target is not None and max(ids) >= num_target:
        raise DrafterConfigError(source, key, f"layer id {max(ids)} >= num_target_layers {num_target}")
    return ids


class _Reader:
    """Typed access to config keys with errors that name the key."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = "") -> None:
        self.raw, self.source, self.prefix = raw, source, prefix

    def _fail(self, key: str, problem: str) -> DrafterConfigError:
        return DrafterConfigError(self.source, self.prefix + key, problem)

    def int(self, key: str, *, minimum: int, default: Any = ...) -> Any:
        if key not in self.raw or self.raw[key] is None:
            if default is ...:
                raise self._fail(key, "missing")
            return default
        v = self.raw[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, f"must be an integer, got {v!r}")
        if v < minimum:
            raise self._fail(key, f"must be >= {minimum}, got {v}")
        return v

    def float(self, key: str) -> float:
        v = self.raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise self._fail(key, "missing" if v is None else f"must be a positive number, got {v!r}")
        return float(v)

    def check_architecture(self) -> None:
        if any(k in self.raw for k in _SPECULATORS_KEYS):
            raise self._fail(next(k for k in _SPECULATORS_KEYS if k in self.raw),
                             "speculators-format DFlash checkpoint; convert it to the z-lab layout first")
        archs = self.raw.get("architectures")
        if not archs:
            raise self._fail("architectures", f"missing; expected [\"{ARCHITECTURE}\"]")
        for arch in archs:
            if any(o.lower() in str(arch).lower() for o in _OTHER_ARCHS):
                raise self._fail("architectures", f"{arch} is a different architecture, not DFlash v1")
        if list(archs) != [ARCHITECTURE]:
            raise self._fail("architectures", f"{archs!r}; expected [\"{ARCHITECTURE}\"]")
        proj = (self.raw.get("dflash_config") or {}).get("projector_type")
        if proj not in (None, "fc", "linear"):
            raise self._fail("dflash_config.projector_type", f"{proj!r} projector is not supported")

    def rope(self) -> dict[str, Any]:
        params = self.raw.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        if isinstance(params, dict) and params.get("rope_theta") is not None:
            out = dict(params)
            key = "rope_parameters"
        else:
            theta = self.raw.get("rope_theta")
            if theta is None:
                raise self._fail("rope_parameters.rope_theta", "missing (and no top-level rope_theta); "
                                 "the drafter's own RoPE settings are required")
            out = dict(self.raw.get("rope_scaling") or {})
            out["rope_theta"] = theta
            key = "rope_theta"
        if "type" in out and "rope_type" not in out:
            out["rope_type"] = out.pop("type")
        out.setdefault("rope_type", "default")
        if isinstance(out["rope_theta"], bool) or not isinstance(out["rope_theta"], (int, float)) \
                or out["rope_theta"] <= 0:
            raise self._fail(key, f"rope_theta must be a positive number, got {out['rope_theta']!r}")
        out["rope_theta"] = float(out["rope_theta"])
        if out["rope_type"] == "dynamic":
            raise self._fail(key, "dynamic RoPE scaling is not supported for drafters")
        return out
