"""The server's OpenAPI 3.1 document (served at GET /openapi.json), true to what the app answers.

FastAPI derives the request bodies from api/schemas.py; this module adds what FastAPI cannot see
because the routes return plain dicts and JSONResponse: every status a route can answer (400 for
validation errors instead of FastAPI's 422, 401, 404, 405, 413, 429, 500, 503), the OpenAI error
envelope, the response bodies (completion, chunk stream, model list, health, readiness) and, with
an API key, the Bearer security scheme on /v1/*. The test suite fuzzes the app against this
document (tests/server/test_api_fuzz.py), so a change of a response shape must be made here too.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from ddtree_server.engine.stats import DecodeStats  # the `decoding` extension, field for field


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    """The OpenAI error envelope of every 4xx/5xx answer."""

    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CalledFunction(_Doc):
    name: str
    arguments: str


class ToolCallOut(_Doc):
    """One call of `message.tool_calls` (api/output.py): arguments as a JSON string."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Doc):
    """One output token (api/logprobs.py): the target's processed distribution at that token."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    decoding: DecodeStats | None


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class TextCompletion(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    decoding: DecodeStats | None


class FunctionDelta(_Doc):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Doc):
    """A piece of one tool call: the first carries id, type and name, the next the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Doc):
    """One event of a chat stream; the last one with `choices: []` carries the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    decoding: DecodeStats | None = None


class TextCompletionChunk(_Doc):
    """One event of a completion stream (OpenAI streams text completions as `text_completion`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    decoding: DecodeStats | None = None


class ModelDecoding(_Doc):
    default_mode: str
    modes: list[str]
    tree_budget: int | None
    max_tree_budget: int
    block_size: int | None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    target: str
    drafter: str | None
    decoding: ModelDecoding


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Load(_Doc):
    """The worker's load: ages in seconds (null when no round runs / nothing waits)."""

    round_age_s: float | None
    oldest_queued_age_s: float | None
    running: int
    queued: int
    stall_seconds: float
    stalled: bool


class Health(Load):
    status: Literal["ok", "unhealthy"]
    state: str
    reason: str | None


class Ready(Load):
    state: str
    detail: str
    elapsed_s: float


_MODELS = (ErrorResponse, ChatCompletion, TextCompletion, ChatCompletionChunk, TextCompletionChunk, ModelList,
           ModelCard, Health, Ready)
_ERRORS = {
    "400": "invalid request (validation, unsupported parameter, context length, tree budget, ...)",
    "401": "missing or wrong API key", "404": "unknown model or route", "405": "method not allowed",
    "413": "request body too large", "429": "queue full", "500": "generation failed",
    "503": "not ready (loading, warming, draining, stopped, failed)",
}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: _json("ErrorResponse", _ERRORS[code]) for code in codes}


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 reads a text/event-stream `schema` as one event): its
    `data` is a JSON chunk, an in-band error envelope, or the final `[DONE]`."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"},
                                             {"$ref": "#/components/schemas/ErrorResponse"}]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}, "event": {"type": "string"}}}


def _generation(name: str, chunk: str) -> dict[str, Any]:
    ok = _json(name, "the completion; with `stream: true` server-sent events ending with `data: [DONE]`")
    ok["content"]["text/event-stream"] = {"schema": _event(chunk)}
    return {"200": ok, **_errors("400", "401", "404", "413", "429", "500", "503")}


# (method, path) -> responses; /v1/* also answer 401 when an API key is set
RESPONSES: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/health"): {"200": _json("Health", "alive"),
                         "503": _json("Health", "unhealthy: worker gone, failed, or a round older than --stall-seconds")},
    ("get", "/ready"): {"200": _json("Ready", "state ready"), "503": _json("Ready", "not ready")},
    ("get", "/metrics"): {"200": {"description": "Prometheus text format",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}},
    ("get", "/v1/models"): {"200": _json("ModelList", "the served model"), **_errors("401", "503")},
    ("get", "/v1/models/{model_id}"): {"200": _json("ModelCard", "the served model"),
                                       **_errors("401", "404", "503")},
    ("post", "/v1/chat/completions"): _generation("ChatCompletion", "ChatCompletionChunk"),
    ("post", "/v1/completions"): _generation("TextCompletion", "TextCompletionChunk"),
}


def _limit_tree_budget(schemas: dict[str, Any], max_tree_budget: int) -> None:
    """The request schema's `decoding.tree_budget` maximum is this server's --max-tree-budget."""
    prop = schemas.get("DecodingOverride", {}).get("properties", {}).get("tree_budget", {})
    for option in prop.get("anyOf", [prop]):
        if option.get("type") == "integer":
            option["maximum"] = max_tree_budget


def document(app: FastAPI, *, api_key: bool, max_tree_budget: int | None = None) -> dict[str, Any]:
    """The OpenAPI document of `app` (cached on `app.openapi_schema`); `max_tree_budget` is the
    server's limit on `decoding.tree_budget`."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=__doc__.split("\n\n")[0],
                      routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for model in _MODELS:
        found = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
    if max_tree_budget is not None:
        _limit_tree_budget(schemas, max_tree_budget)
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            operation["responses"] = RESPONSES.get((method, path), operation.get("responses", {}))
            if api_key and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
    app.openapi_schema = doc
    return doc
