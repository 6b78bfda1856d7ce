"""Server-sent events: framing and the chunk sequence of a streamed completion.

Every event is `data: <json>\\n\\n`; a stream always ends with `data: [DONE]\\n\\n`, also after an
error (sent as `data: {"error": {...}}`). Chat streams start with a chunk whose delta carries the
role; the chunk that carries `finish_reason` also carries the `decoding` statistics; with
`stream_options.include_usage` every chunk has `"usage": null` and one last chunk has
`"choices": []`, the usage and the statistics. With logprobs requested, each content chunk carries
the logprobs of the tokens released since the previous chunk (api/logprobs.py).
"""

from __future__ import annotations

import asyncio
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

    def role(self, index: int = 0) -> dict[str, Any] | None:
        """The opening chunk of a chat stream's choice (None for text completions)."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def delta(self, text: str, finish_reason: str | None, decoding: dict | None,
              logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
        """A content chunk of choice `index`; its last one carries `finish_reason` and `decoding`."""
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = self._chunk([choice])
        if finish_reason is not None:
            chunk["decoding"] = decoding
        return chunk

    def chat_delta(self, delta: dict[str, Any], finish_reason: str | None = None,
                   decoding: dict | None = None, index: int = 0) -> dict[str, Any]:
        """A chat chunk of choice `index` carrying one delta object of api/output.py (reasoning,
        content, tool calls)."""
        chunk = self._chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])
        if finish_reason is not None:
            chunk["decoding"] = decoding
        return chunk

    def usage(self, prompt_tokens: int, completion_tokens: int, decoding: dict | None) -> dict[str, Any]:
        """The final `choices: []` chunk with the token counts (only with include_usage)."""
        chunk = self._chunk([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        chunk["decoding"] = decoding
        return chunk


def _chunks(shape: ChunkShape, event: Any, stats: dict | None, parser: Any, index: int) -> list[dict[str, Any]]:
    """The chunks of one engine event of choice `index`: as they are, or through the chat output parser."""
    if parser is None or not parser.active:
        if event.text or event.finish_reason is not None:
            return [shape.delta(event.text, event.finish_reason, stats, index=index)]
        return []
    deltas = parser.feed(event.text)
    if event.finish_reason is None:
        return [shape.chat_delta(delta, index=index) for delta in deltas]
    deltas += parser.finish()
    return [shape.chat_delta(delta, index=index) for delta in deltas] + [
        shape.chat_delta({}, parser.finish_reason(event.finish_reason), stats, index=index)]


async def event_stream(shape: ChunkShape, first: Any | list[Any], next_event: Callable[[], Awaitable[Any]] | list, *,
                       prompt_tokens: int, on_close: Callable[[bool], None],
                       parser: Any = None) -> AsyncIterator[bytes]:
    """The SSE bytes of one generation, or of the n choices of one request (lists of firsts,
    next-event functions and parsers; choice i's chunks carry index i, in the order their events
    arrive).

    `first` is the first GenerationEvent (already received, so that errors before it became HTTP
    errors); `next_event()` returns the following ones and None at the end. `on_close(finished)`
    runs exactly once when the stream ends or is abandoned (client gone: finished is False).
    `parser` (chat, api/output.py) turns text into reasoning / content / tool-call deltas; then
    the chunk with `finish_reason` has an empty delta.
    """
    firsts = first if isinstance(first, list) else [first]
    nexts = next_event if isinstance(next_event, list) else [next_event]
    parsers = parser if isinstance(parser, list) else [parser] * len(firsts)
    finished, tasks = False, {}
    try:
        for i in range(len(firsts)):
            opening = shape.role(i)
            if opening is not None:
                yield sse(opening)
        generated, totals, open_, failed = [0] * len(firsts), 0, set(range(len(firsts))), False
        pending, offset = [[] for _ in firsts], [0] * len(firsts)
        ready = [(i, ev) for i, ev in enumerate(firsts)]
        while ready or tasks:
            for i, event in ready:
                generated[i] += len(event.token_ids)
                pending[i] += event.logprobs or []
                stats = event.stats.to_dict() if event.stats is not None else None
                chunks = _chunks(shape, event, stats, parsers[i], i)
                if chunks:
                    if shape.logprobs is not None:   # the tokens so far ride on the next chunk sent
                        chunks[0]["choices"][0]["logprobs"] = shape.logprobs(pending[i], offset[i])
                    pending[i], offset[i] = [], offset[i] + len(event.text)
                for chunk in chunks:
                    yield sse(chunk)
                if event.finish_reason is not None:
                    open_.discard(i)
                    totals += stats.get("generated_tokens", generated[i]) if stats else generated[i]
                    if not open_ and shape.include_usage:
                        yield sse(shape.usage(prompt_tokens, totals, stats))
                else:
                    tasks[asyncio.ensure_future(nexts[i]())] = i
            ready = []
            if not tasks:
                break
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = tasks.pop(task)
                try:
                    event = task.result()
                except Exception as exc:   # the engine failed mid-stream: report it in-band
                    log.exception("generation %s failed mid-stream", shape.rid)
                    yield sse(error_body(f"generation failed: {exc}", type="server_error"))
                    failed = True
                    break
                if event is not None:
                    ready.append((i, event))
                else:
                    open_.discard(i)
            if failed:
                break
        finished = True
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        on_close(finished)
