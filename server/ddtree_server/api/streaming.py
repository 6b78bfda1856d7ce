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

    def chat_delta(self, delta: dict[str, Any], finish_reason: str | None = None,
                   decoding: dict | None = None) -> dict[str, Any]:
        """A chat chunk carrying one delta object of api/output.py (reasoning, content, tool calls)."""
        chunk = self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        if finish_reason is not None:
            chunk["decoding"] = decoding
        return chunk

    def usage(self, prompt_tokens: int, completion_tokens: int, decoding: dict | None) -> dict[str, Any]:
        """The final `choices: []` chunk with the token counts (only with include_usage)."""
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        chunk["decoding"] = decoding
        return chunk


def _chunks(shape: ChunkShape, event: Any, stats: dict | None, parser: Any) -> list[dict[str, Any]]:
    """The chunks of one engine event: as they are, or through the chat output parser."""
    if parser is None or not parser.active:
        if event.text or event.finish_reason is not None:
            return [shape.delta(event.text, event.finish_reason, stats)]
        return []
    deltas = parser.feed(event.text)
    if event.finish_reason is None:
        return [shape.chat_delta(delta) for delta in deltas]
    deltas += parser.finish()
    return [shape.chat_delta(delta) for delta in deltas] + [
        shape.chat_delta({}, parser.finish_reason(event.finish_reason), stats)]


async def event_stream(shape: ChunkShape, first: Any, next_event: Callable[[], Awaitable[Any]], *,
                       prompt_tokens: int, on_close: Callable[[bool], None],
                       parser: Any = None) -> AsyncIterator[bytes]:
    """The SSE bytes of one generation.

    `first` is the first GenerationEvent (already received, so that errors before it became HTTP
    errors); `next_event()` returns the following ones and None at the end. `on_close(finished)`
    runs exactly once when the stream ends or is abandoned (client gone: finished is False).
    `parser` (chat, api/output.py) turns text into reasoning / content / tool-call deltas; then
    the chunk with `finish_reason` has an empty delta.
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
            chunks = _chunks(shape, event, stats, parser)
            if chunks:
                if shape.logprobs is not None:   # the tokens so far ride on the next chunk sent
                    chunks[0]["choices"][0]["logprobs"] = shape.logprobs(pending, offset)
                pending, offset = [], offset + len(event.text)
            for chunk in chunks:
                yield sse(chunk)
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
