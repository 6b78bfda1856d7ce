"""Response bodies and errors of the OpenAI-compatible API (request models: api/schemas.py).

* `ApiError` / `error_body`: the OpenAI error envelope `{"error": {message, type, param, code}}`;
* `chat_response` / `completion_response` / `model_card` and their helpers (`new_id`, `now`,
  `usage`): plain dicts, serialised by the app as they are. Every response carries the extension
  field `decoding` = `DecodeStats.to_dict()`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


# ---- errors ---------------------------------------------------------------------------------

class ApiError(Exception):
    """A client-visible error: HTTP `status` and an OpenAI-style error object.

    `type` is "invalid_request_error" for 4xx client mistakes, "authentication_error" (401),
    "rate_limit_error" (429), "service_unavailable" (503) and "server_error" (500).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`, the OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- responses ------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    """A fresh response id such as `chatcmpl-3f2a...` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in whole seconds (the `created` field)."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _many(text, finish_reason, logprobs, message=None) -> list[tuple]:
    """(text, finish_reason, logprobs, message) per choice from one value each or lists of the n
    choices."""
    if isinstance(text, str):
        return [(text, finish_reason, logprobs, message)]
    none = [None] * len(text)
    return list(zip(text, finish_reason, logprobs if logprobs is not None else none,
                    message if message is not None else none))


def chat_response(*, rid: str, created: int, model: str, text: str | list[str], finish_reason,
                  prompt_tokens: int, completion_tokens: int, decoding: dict | None,
                  message=None, logprobs=None) -> dict[str, Any]:
    """A complete `chat.completion` object (``text`` / ``finish_reason`` / ``message`` / ``logprobs``:
    lists for n choices); a `message` (api/output.py) replaces the plain text one; `logprobs`:
    api/logprobs.py's chat object or None."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": m or {"role": "assistant", "content": t},
                         "logprobs": lp, "finish_reason": f}
                        for i, (t, f, lp, m) in enumerate(_many(text, finish_reason, logprobs, message))],
            "usage": usage(prompt_tokens, completion_tokens), "decoding": decoding}


def completion_response(*, rid: str, created: int, model: str, text: str | list[str], finish_reason,
                        prompt_tokens: int, completion_tokens: int, decoding: dict | None,
                        logprobs=None) -> dict[str, Any]:
    """A complete `text_completion` object (``text`` / ``finish_reason`` / ``logprobs``: lists for
    n choices; `logprobs`: api/logprobs.py's completions object or None)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": t, "logprobs": lp, "finish_reason": f}
                        for i, (t, f, lp, _) in enumerate(_many(text, finish_reason, logprobs))],
            "usage": usage(prompt_tokens, completion_tokens), "decoding": decoding}


def model_card(*, model_id: str, created: int, max_model_len: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One entry of `GET /v1/models` (`max_model_len` in tokens, plus extension fields)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "ddtree-server",
            "max_model_len": max_model_len, **extra}
