"""ServerConfig: everything `ddtree-server serve` needs to load a model and serve it.

The values come from the command line (`ddtree_server.commands.serve`) or from code (tests, bench).
Model files are only *named* here; `ddtree_server.models` locates and verifies them. `None` means
"the documented default", resolved by the component that owns that default:

* `target` and `gguf` both `None` -> the embedded SmolLM2 GGUF (`ddtree_server.models.default`).
* `drafter` `None` -> the shipped drafter in `ddtree_server/assets/drafter` when present and
  compatible with the target, otherwise no drafter (autoregressive decoding only).
* `mode` `None` -> the engine picks ddtree when a drafter is loaded and the target supports tree
  attention, else ar (targets that cannot verify trees, e.g. hybrids, are served with plain decoding).
* `device` / `dtype` are resolved here: cuda when available, else cpu; bf16 on cuda, fp32 on cpu.
* `spec_policy` `fixed` -> modes and budgets as given; `auto` -> the speculation policy chooses every
  ddtree request's tree round by round (one global node budget; the request's tree budget is its cap).
  `fixed` is the default because `auto` measured slower than fixed DDTree and plain decoding
  (docs/benchmarks/h200-2026-12-02-batched-serving/).
* `spec_gate` `True` -> the speculation gate (engine/batch/gate.py) runs a round of speculative
  requests plainly when plain rounds are measured faster at that batch size (a busy server, a poor
  drafter), so the default mode never runs slower than batched plain decoding; `False` -> never.
* `max_tree_budget` `None` -> `DEFAULT_MAX_TREE_BUDGET[device]`, raised to `tree_budget` when that
  is larger (`tree_budget_limit`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Mode = Literal["ar", "dflash", "ddtree"]
Device = Literal["cuda", "cpu"]
DType = Literal["bf16", "fp32"]

# Keyword names apply_chat_template() reserves for itself; never accepted as template kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "return_tensors", "return_dict",
     "padding", "truncation", "max_length", "tools", "documents", "chat_template",
     "continue_final_message", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)


# Largest per-request DDTree budget by default (nodes). CUDA: 256, the largest budget the benchmark
# measured (docs/benchmarks/RESULTS.md: speed falls past 64-128 nodes as the verify forward grows);
# a tree of up to 511 nodes still replays from the target's CUDA graphs (buckets up to 512 tokens,
# models/dense/graphs.py), larger trees run eagerly and a 4096-node round was ~18x slower. CPU: 64, four
# times the default budget (block_size - 1 = 15), because on the CPU the verify forward costs about
# linearly in the node count.
DEFAULT_MAX_TREE_BUDGET = {"cuda": 256, "cpu": 64}


def check_api_key(value: str | None) -> str | None:
    """The API key as the server uses it: None (authentication off) for None or "".

    A key must be visible ASCII (0x21-0x7E): clients send it in an `Authorization: Bearer` header,
    whose value is ASCII (RFC 9110 §5.5; RFC 6750 §2.1 allows no spaces in the token). Raises
    ValueError for a blank key (only whitespace), a non-ASCII character, a control character or
    whitespace; the message names the position, never the key.
    """
    if not value:
        return None
    where = "(the key comes from --api-key or $DDTREE_API_KEY)"
    if not value.strip():
        raise ValueError(f"the API key is blank (only whitespace) {where}: give a key of visible ASCII "
                         "characters, or an empty value to turn authentication off")
    for i, ch in enumerate(value):
        if ord(ch) > 0x7E:
            kind = "a non-ASCII character" if ord(ch) > 0x7F else "a control character (DEL)"
        elif ch in " \t\n\r\v\f":
            kind = "whitespace"
        elif ord(ch) < 0x20:
            kind = f"a control character (0x{ord(ch):02x})"
        else:
            continue
        raise ValueError(f"the API key contains {kind} at position {i} {where}: clients send the key in "
                         "an Authorization header, so it must be visible ASCII (0x21-0x7E) without spaces")
    return value


def cuda_available() -> bool:
    import torch  # local import: only resolving the default device needs torch

    return bool(torch.cuda.is_available())


class ServerConfig(BaseModel):
    """Validated server settings (immutable).

    Raises `pydantic.ValidationError` on construction for out-of-range or contradictory values
    (both `target` and `gguf`, a missing file or folder, a tree budget below 1, bad JSON, ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Path | None = Field(None, description="Hugging Face model folder of the target model.")
    gguf: Path | None = Field(None, description="GGUF file of the target model.")
    drafter: Path | None = Field(None, description="z-lab DFlash drafter folder (config.json + safetensors).")
    target_layer_ids: list[int] | None = Field(
        None, description="Operator override of the drafter's target_layer_ids (decoder layer indices)."
    )
    mode: Mode | None = Field(None, description="Default decoding mode; requests may override it.")
    tree_budget: int | None = Field(None, ge=1, le=4096, description="Default DDTree node budget (nodes).")
    spec_policy: Literal["auto", "fixed"] = Field(
        "fixed", description="auto: the speculation policy chooses each round's draft nodes (plain / chain / tree "
                            "per ddtree request, one global node budget); fixed: every request's mode and tree "
                            "budget as given.")
    spec_gate: bool = Field(
        True, description="Run a round of speculative requests plainly when plain rounds are measured faster at "
                          "that batch size (engine/batch/gate.py).")
    max_tree_budget: int | None = Field(
        None, ge=1, le=4096,
        description="Largest decoding.tree_budget a request may ask for (nodes; larger: 400). "
                    "Default: 256 on cuda, 64 on cpu, or --tree-budget when that is larger.")
    stall_seconds: float = Field(
        300.0, gt=0, allow_inf_nan=False,
        description="An engine round running this long makes /health 503 (stuck, not busy) (s).")
    host: str = Field("127.0.0.1", min_length=1, description="Listen address.")
    port: int = Field(8000, ge=0, le=65535, description="Listen port (0: any free port).")
    device: Device = Field(None, validate_default=False, description="cuda | cpu (default: cuda if available).")
    dtype: DType = Field(None, validate_default=False, description="bf16 | fp32 (default: bf16 on cuda, fp32 on cpu).")
    api_key: str | None = Field(None, repr=False, description=(
        "Bearer token required on /v1/* when set: visible ASCII, no spaces; None or '' turns authentication off."))
    served_model_name: str | None = Field(None, description="Model id shown in /v1/models and responses.")
    max_model_len: int | None = Field(None, ge=16, description="Context window in tokens (default: the model's).")
    max_queue: int = Field(64, ge=0, description="Requests waiting for the worker before 429 (requests).")
    max_running: int | None = Field(None, ge=1, description=(
        "Requests decoded together in one batched step (requests; default: 4 on cpu, sized from free "
        "GPU memory on cuda, at most 64)."))
    max_concurrency: int | None = Field(None, ge=1, description="Deprecated alias of max_running.")
    kv_memory_fraction: float = Field(
        0.5, gt=0, le=1, allow_inf_nan=False,
        description="Share of the free GPU memory after loading that the request slots may take when "
                    "max_running is not given (cuda): max_running = this x free / bytes per slot, at most 64.")
    kv_layout: Literal["auto", "slot", "paged"] = Field("auto", description=(
        "Where the target's K/V lives: slot (every request slot at max_model_len from start-up), paged "
        "(pages of 16 tokens, a hybrid's GDN states per slot; admission and look-ahead by free pages, "
        "preemption of the newest request by recompute when pages run out) or auto (paged on cuda when "
        "the slots at max_model_len would not hold max_running (default 64) requests, else slot)."))
    kv_pages: int | None = Field(None, ge=0, description=(
        "Pages of 16 tokens of the paged layout, page 0 a dummy never handed out (pages; default and 0: "
        "cpu the slots' capacity at max_model_len, cuda what kv_memory_fraction of the free memory holds, "
        "a page holding the target's and the drafter's K/V)."))
    prefill_chunk: int | None = Field(None, ge=0, description=(
        "Prompt tokens per engine step (chunked prefill, interleaved with decode rounds; tokens; "
        "default 512 on cuda, 128 on cpu; 0: every prompt whole in one step)."))
    round_rows: int | None = Field(None, ge=1, description=(
        "Rows of a hybrid target's round verify scratch, allocated once (rows; default 1024, fewer for "
        "a few slots); a round's draft trees are cut to fit it."))
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Default keyword arguments for the chat template (requests may add)."
    )
    drain_timeout_s: float = Field(120.0, ge=0, description="Longest wait for in-flight requests on SIGTERM (s).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("device") is None:
                data["device"] = "cuda" if cuda_available() else "cpu"
            if data.get("dtype") is None:
                data["dtype"] = "bf16" if data["device"] == "cuda" else "fp32"
        return data

    @field_validator("api_key")
    @classmethod
    def _usable_api_key(cls, value: str | None) -> str | None:
        return check_api_key(value)

    @field_validator("target_layer_ids", mode="before")
    @classmethod
    def _parse_layer_ids(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [p.strip() for p in value.replace(" ", ",").split(",") if p.strip()]
            try:
                return [int(p) for p in parts]
            except ValueError:
                raise ValueError(f"expected comma-separated layer indices, got {value!r}") from None
        return value

    @field_validator("target_layer_ids")
    @classmethod
    def _check_layer_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("must name at least one layer")
            if any(i < 0 for i in value):
                raise ValueError("layer indices must be >= 0")
        return value

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _parse_template_kwargs(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        if value is None:
            return {}
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
        if clash:
            raise ValueError(f"reserved keys not allowed: {', '.join(clash)}")
        return value

    @model_validator(mode="after")
    def _check_paths(self) -> ServerConfig:
        if self.target is not None and self.gguf is not None:
            raise ValueError("give either --target or --gguf, not both")
        if self.target is not None and not self.target.is_dir():
            raise ValueError(f"--target {self.target}: not a directory")
        if self.gguf is not None and not self.gguf.is_file():
            raise ValueError(f"--gguf {self.gguf}: no such file")
        if self.drafter is not None and not self.drafter.is_dir():
            raise ValueError(f"--drafter {self.drafter}: not a directory")
        if (self.tree_budget is not None and self.max_tree_budget is not None
                and self.tree_budget > self.max_tree_budget):
            raise ValueError(f"--tree-budget {self.tree_budget} is above --max-tree-budget {self.max_tree_budget}")
        return self

    @property
    def tree_budget_limit(self) -> int:
        """The largest tree budget a request may use (nodes): `max_tree_budget`, else the device
        default (`DEFAULT_MAX_TREE_BUDGET`) or `tree_budget` when that is larger."""
        if self.max_tree_budget is not None:
            return self.max_tree_budget
        return max(DEFAULT_MAX_TREE_BUDGET[self.device], self.tree_budget or 0)

    @property
    def torch_dtype(self):
        """The torch dtype for `dtype` (imports torch)."""
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]
