"""Request bodies of the OpenAI-compatible API (the subset we serve + extensions); responses and
errors: api/responses.py.

Extensions over the OpenAI schema:

* request `decoding: {"mode": "ar"|"dflash"|"ddtree", "tree_budget": N}` overrides the server's
  default decoding for one request (clients send it with `extra_body`);
* request `chat_template_kwargs: {...}` (chat only) is passed to the tokenizer's chat template;
* every response, and the final chunk of every stream, carries `decoding` = `DecodeStats.to_dict()`.

Known fields are validated strictly (pydantic strict mode: `"5"` or `5.0` is no integer, `false` no
number, `0` no boolean), so the OpenAPI document generated from these models is the contract the
handler enforces. Unknown request fields are ignored (OpenAI clients send many optional ones); fields we cannot honour
are rejected with 400 ("... is not supported by this server") rather than silently ignored: `n` > 1,
`best_of` > 1, several prompts, non-text content parts, `tool_choice` "required" or naming a
function without a tool grammar, tools on /v1/completions. `stream` must be a JSON boolean;
sampling numbers must be JSON numbers (not booleans). system / developer / user messages need
text content. Chat `tools`, `tool_choice`, `parallel_tool_calls` and the messages' `tool_calls` /
`tool_call_id` are served by api/tools/.

Logits processing, exact under speculation (engine/processors.py): `response_format` `text`,
`json_object` or `json_schema` (compiled to a grammar, constrained/compiler.py; a schema it refuses
is a 400 naming the problem), `logit_bias` (token id -> [-100, 100]), `presence_penalty` /
`frequency_penalty` in [-2, 2], `repetition_penalty` in [0.01, 100] (vLLM's extension; 1 = off). Logprobs:
chat `logprobs: true` + `top_logprobs` 0..20, completions `logprobs` 0..20 (api/logprobs.py).

`seed` must be a 64-bit signed integer, -2**63 <= seed < 2**63 (OpenAI's range; anything else is
400 with param "seed"); torch seeds the request's generator with it modulo 2**64, so every value
in the range is reproducible and distinct.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationInfo, field_validator

from ddtree_server.api.tools.schemas import Tool, ToolCall, ToolChoice, check_tools

Role = Literal["system", "developer", "user", "assistant", "tool"]
# A JSON number, never a boolean or a string (pydantic's lax mode would read `false` as 0.0).
Number = Annotated[float, Field(strict=True)]


def check_text(value: str) -> str:
    """`value` unchanged; ValueError when it is not encodable as UTF-8 (a lone surrogate such as
    JSON's "\\ud800"), which the tokenizer could not handle."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode text: lone surrogate {value[exc.start]!r} at index {exc.start}") from None
    return value


MAX_CHOICES = 16  # most choices (n) one request may ask for


class DecodingOverride(BaseModel):
    """Per-request decoding override (extension field `decoding`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["ar", "dflash", "ddtree"] | None = None
    tree_budget: int | None = Field(None, ge=1, le=4096, description=(
        "DDTree node budget; at most the server's --max-tree-budget (model card: decoding.max_tree_budget)."))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part (the only part type we accept)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat message. `content` is text or a list of text parts; assistant/tool may send null."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: StrictStr | None = Field(None, description="tool: the id of the call this result answers")

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and role in ("system", "developer", "user"):
            raise ValueError(f"a {role} message needs content (a string or a list of text parts)")
        return value

    @field_validator("content", "name")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if isinstance(value, str):
            check_text(value)
        elif isinstance(value, list):
            for part in value:
                check_text(part.text)
        return value

    def text(self) -> str:
        """The message text: content parts joined without separator; null content is ''."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _GenerationRequest(BaseModel):
    """Fields shared by chat and text completions (OpenAI names, OpenAI ranges)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: StrictStr | None = None
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (tokens).")
    temperature: Number | None = Field(None, ge=0.0, le=2.0, description=(
        "Omitted: the model's generation_config, else 1.0. Below 1e-5 (0 included): greedy decoding "
        "(engine/sampling.py GREEDY_TEMPERATURE)."))
    top_p: Number | None = Field(None, gt=0.0, le=1.0, description=(
        "Nucleus mass; the most probable token is always kept (a top_p that rounds to 0 in fp32 is top-1)."))
    top_k: int | None = Field(None, ge=-1, description=(
        "vLLM's extension: sample from the k most probable tokens (before top_p); 0 or -1 = off. "
        "Omitted: the model's generation_config, else off."))
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1,
                             description="OpenAI's int64 range; negative seeds are taken modulo 2**64.")
    stop: StrictStr | list[StrictStr] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=(
        "Choices per request, each generated as its own request in the same batch; with a seed, "
        "choice i samples with seed + i."))
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    decoding: DecodingOverride | None = None
    ignore_eos: bool = False
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    presence_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, ge=0.01, le=100.0, description=(
        "vLLM's extension: > 1 discourages repeats (1 = off); [0.01, 100] keeps logits finite."))

    @field_validator("stream")
    @classmethod
    def _stream_bool(cls, value: bool | None) -> bool:
        return bool(value)

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("best_of > 1 is not supported by this server")
        return value

    @field_validator("echo", "suffix", check_fields=False)
    @classmethod
    def _empty_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {value.get('type')!r} is not supported "
                             "(use 'text', 'json_object' or 'json_schema')")
        return value

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     mode="before")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    def token_bias(self) -> dict[int, float]:
        """`logit_bias` with integer keys."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        for stop in stops:
            check_text(stop)
        return stops


    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, description="OpenAI function tools (api/tools/).")
    tool_choice: ToolChoice | None = Field(None, description=(
        '"auto" (default with tools), "none", "required" or a named function (both constrained by a grammar)'))
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call per answer")

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        return check_tools(value)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in ("none", "auto"):
            return value
        tools = info.data.get("tools")
        if not tools:
            raise ValueError(f"tool_choice {value if isinstance(value, str) else 'naming a function'!r} "
                             "needs tools")
        if not isinstance(value, str) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names the function {value.function.name!r}, which is not in tools")
        return value   # "required" / named: a tool-call grammar (api/prompts.py tool_grammar)

    logprobs: StrictBool | None = Field(None, description="Return the logprob of every output token.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Alternatives per token (needs logprobs).")

    def logprob_count(self) -> int | None:
        """Alternatives per token for the engine; None when logprobs are off. Raises ValueError
        for top_logprobs without logprobs."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs requires logprobs: true")
            return None
        return self.top_logprobs or 0

    def token_limit(self) -> int | None:
        """`max_completion_tokens` (newer name) wins over `max_tokens`; None -> rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _as_prompt(value: Any) -> str | list[int]:
    """One prompt: a string or a list of token ids (ints). Raises ValueError otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(type(t) is int for t in value):
        return value
    raise ValueError("prompt must be a string, a list of one string, a list of token ids "
                     "or a list of one list of token ids")


NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_GenerationRequest):
    prompt: Union[NonEmptyText, TokenIds, Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)],
                  Annotated[list[TokenIds], Field(min_length=1, max_length=1)]] = Field(
        ..., description="Tokenised verbatim: no chat template. One prompt: a string or token ids, "
                         "alone or as a list of one.")
    tools: list[Any] | None = Field(None, description="chat only: refused when non-empty")
    tool_choice: Any = Field(None, description="chat only: refused unless null or \"none\"")

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: Any) -> Any:
        if value:
            raise ValueError("tools are supported on /v1/chat/completions only")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        if value not in (None, "none"):
            raise ValueError("tool_choice is supported on /v1/chat/completions only")
        return value
    echo: bool = False
    suffix: StrictStr | None = None
    max_tokens: int | None = Field(16, ge=1, description="Most tokens to generate (OpenAI default 16).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Logprobs of each token and this many alternatives.")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int_logprobs(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be an integer")
        return value

    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            value = value[0]
        prompt = _as_prompt(value)
        if isinstance(prompt, str):
            check_text(prompt)
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    def token_limit(self) -> int | None:
        return self.max_tokens
