"""Server-sent events: framing and the chunk sequence of a streamed completion.

Every event is `data: <json>\\n\\n`; a stream always ends with `data: [DONE]\\n\\n`, also after an
error (sent as `data: {"error": {...}}`). Chat streams start with a chunk whose delta carries the
role; the chunk that carries `finish_reason` also carries the `decoding` statistics; with
`stream_options.include_usage` every chunk has `"usage": null` and one last chunk has
`"choices": []`, the usage and the statistics. With logprobs requested, each content chunk carries
the logprobs of the tokens released since the previous chunk (api/logprobs.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from ddtree_server.api.responses import error_body, usage

log = logging.getLogger("ddtree_server.api")

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as compact JSON (UTF-8)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class ChunkShape:
    """Builds the chunks of one stream: `kind` is "chat" or "completion"."""

    kind: str
    rid: str
    created: int
    model: str
    include_usage: bool
    logprobs: Optional[Callable[..., dict[str, Any]]] = None   # (entries, text offset) -> logprobs object

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk: dict[str, Any] = {"id": self.rid, "object": obj, "created": self.created,
                                 "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role(self) -> dict[str, Any] | None:
        """The opening chunk of a chat stream (None for text completions)."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta(self, text: str, finish_reason: str | None, decoding: dict | None,
              logprobs: dict | None = None) -> dict[str, Any]:
        """A content chunk; the last one carries `finish_reason` and `decoding`."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = self._chunk([choice])
        if finish_reason is not None:
            chunk["decoding"] = decoding
        return chunk

    def usage(self, prompt_tokens: int, completion_tokens: int, decoding: dict | None) -> dict[str, Any]:
        """The final `choices: []` chunk with the token counts (only with include_usage)."""
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        chunk["decoding"] = decoding
        return chunk


async def event_stream(shape: ChunkShape, first: Any, next_event: Callable[[], Awaitable[Any]], *,
                       prompt_tokens: int, on_close: Callable[[bool], None]) -> AsyncIterator[bytes]:
    """The SSE bytes of one generation.

    `first` is the first GenerationEvent (already received, so that errors before it became HTTP
    errors); `next_event()` returns the following ones and None at the end. `on_close(finished)`
    runs exactly once when the stream ends or is abandoned (client gone: finished is False).
    """
    finished = False
    try:
        opening = shape.role()
        if opening is not None:
            yield sse(opening)
        event, generated, pending, offset = first, 0, [], 0
        while event is not None:
            generated += len(event.token_ids)
            pending += event.logprobs or []
            stats = event.stats.to_dict() if event.stats is not None else None
            if event.text or event.finish_reason is not None:
                lps = shape.logprobs(pending, offset) if shape.logprobs is not None else None
                yield sse(shape.delta(event.text, event.finish_reason, stats, lps))
                pending, offset = [], offset + len(event.text)
            if event.finish_reason is not None:
                if shape.include_usage:
                    tokens = stats.get("generated_tokens", generated) if stats else generated
                    yield sse(shape.usage(prompt_tokens, tokens, stats))
                break
            try:
                event = await next_event()
            except Exception as exc:   # the engine failed mid-stream: report it in-band
                log.exception("generation %s failed mid-stream", shape.rid)
                yield sse(error_body(f"generation failed: {exc}", type="server_error"))
                break
        finished = True
        yield DONE
    finally:
        on_close(finished)
