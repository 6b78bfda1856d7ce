"""Pure ASGI middleware of the API: the API-key check on /v1/*, the request body limit and the
per-request metrics (status by endpoint).

Auth: `Authorization: Bearer <key>` (scheme case-insensitive, RFC 6750 §2.1), compared as raw
bytes in constant time (`hmac.compare_digest`), so a header value of any bytes is a 401, never an
error. Body limit: a `Content-Length` above MAX_BODY_BYTES is answered 413 before the app runs; a
body without one (chunked) is counted as it arrives and cut off with 413 once over the limit.
Written here rather than with FastAPI's own body limit, which needs a newer FastAPI than the one
server/pyproject.toml allows.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_server.api.metrics import Metrics
from ddtree_server.api.responses import error_body

MAX_BODY_BYTES = 16 << 20  # largest request body (bytes): a whole 128k-token context is ~1-3 MB of JSON


def _too_large() -> StarletteHTTPException:
    return StarletteHTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")


class Middleware:
    """Pure ASGI middleware: API-key check on /v1/*, the body size limit (Content-Length, then the
    bytes actually received) and per-request metrics (status by endpoint)."""

    def __init__(self, app: Any, *, api_key: str | None, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode("utf-8") if api_key else None   # compared as bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope.get("path", ""), [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key and path.startswith("/v1/") and not self._authorised(scope):
                status[0] = 401
                body = error_body("invalid or missing API key (send Authorization: Bearer <key>)",
                                  code="invalid_api_key")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            if self._declared_length(scope) > MAX_BODY_BYTES:
                status[0] = 413
                response = JSONResponse(error_body(_too_large().detail, code="request_too_large"), status_code=413)
                return await response(scope, receive, send)
            received = 0

            async def limited_receive() -> dict:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > MAX_BODY_BYTES:
                        raise _too_large()   # FastAPI re-raises HTTPExceptions from body reading
                return message

            await self.app(scope, limited_receive, send_wrapper)
        finally:
            self.metrics.count_request(path, status[0])

    @staticmethod
    def _declared_length(scope: dict) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                return int(value) if value.isdigit() else 0
        return 0

    def _authorised(self, scope: dict) -> bool:
        """`Authorization: Bearer <key>` (scheme case-insensitive, RFC 6750 §2.1), compared in
        constant time as raw bytes: any header value, ASCII or not, is simply a wrong key."""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False
