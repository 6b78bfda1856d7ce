"""Split a chat completion's text, as it streams, into reasoning, content and tool calls.

One `OutputParser` per request is fed the engine's text pieces in order; it returns OpenAI delta
objects (`{"reasoning_content": ...}`, `{"content": ...}`, `{"tool_calls": [...]}`) and
`message()` assembles the same deltas into the non-streamed message, so a stream and a plain
response are identical by construction. Markup never reaches `content` while its meaning is
undecided: text that may be the start of a tag is held back until the next piece decides it.

* reasoning (templates that think): text up to `</think>` is `reasoning_content`; the parser
  starts inside it when the prompt ends with an open `<think>`, and a completion that starts
  with `<think>` opens it; whitespace after `</think>` is dropped;
* tool calls (a request with tools and tool_choice other than "none"): each
  `<tool_call>...</tool_call>` block is parsed by the format's parser (api/tools/); a call
  becomes a `tool_calls` delta with id, type and name and an empty `arguments`, then one with
  the arguments; a block that does not parse is passed on as plain content (never an error);
  whitespace around calls is dropped, and so is a stray `</tool_call>` after a call (loose
  grammars and small models repeat it); with `parallel_tool_calls: false` only the first call is
  kept. A block left open at the end (also one cut inside its closing tag) is parsed as if it were
  closed, else returned as content.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

Parse = Callable[[str, dict[str, Any]], "tuple[str, str] | None"]


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """`parse` is the tool-call format's block parser (None: tool calls are not parsed);
    `functions` the request's tools by name; `reasoning` whether the template thinks and
    `in_reasoning` whether the prompt left `<think>` open."""

    def __init__(self, *, parse: Parse | None = None, functions: dict[str, Any] | None = None,
                 reasoning: bool = False, in_reasoning: bool = False, parallel: bool = True) -> None:
        self.parse, self.functions, self.reasoning, self.parallel = parse, functions or {}, reasoning, parallel
        self.state = "reasoning" if reasoning and in_reasoning else "content"
        self.buf, self.held_ws = "", ""
        self.at_start = True          # no content emitted yet: a leading <think> opens reasoning
        self.skip_ws = False          # drop whitespace (after </think> or a tool call)
        self.calls = 0
        self.deltas: list[dict[str, Any]] = []

    @property
    def active(self) -> bool:
        """False when the parser passes text through unchanged (no tools, no reasoning)."""
        return self.parse is not None or self.reasoning

    # ---- emitting ----------------------------------------------------------------------------
    def _emit(self, out: list[dict[str, Any]], delta: dict[str, Any]) -> None:
        out.append(delta)
        self.deltas.append(delta)

    def _content(self, out: list[dict[str, Any]], text: str) -> None:
        if self.skip_ws:
            text = text.lstrip()
            if not text:
                return
            self.skip_ws = False
        if self.parse is None:
            if text:
                self.at_start = False
                self._emit(out, {"content": text})
            return
        text = self.held_ws + text
        body = text.rstrip()
        self.held_ws = text[len(body):]
        if body:
            self.at_start = False
            self._emit(out, {"content": body})

    def _call(self, out: list[dict[str, Any]], block: str, closed: bool) -> None:
        parsed = self.parse(block, self.functions) if self.parse else None
        if parsed is None:
            self._content(out, CALL_OPEN + block + (CALL_CLOSE if closed else ""))
            return
        self.held_ws, self.skip_ws, self.at_start = "", True, False
        if self.calls and not self.parallel:
            return
        name, arguments = parsed
        index, self.calls = self.calls, self.calls + 1
        self._emit(out, {"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})
        self._emit(out, {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})

    # ---- the state machine ---------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text` (the next piece of the completion) decides."""
        out: list[dict[str, Any]] = []
        if not self.active:
            if text:
                self._emit(out, {"content": text})
            return out
        self.buf += text
        while self.buf:
            if self.state == "reasoning":
                end = self.buf.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_tail(self.buf, THINK_CLOSE)
                    if len(self.buf) > keep:
                        self._emit(out, {"reasoning_content": self.buf[:len(self.buf) - keep]})
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                if end:
                    self._emit(out, {"reasoning_content": self.buf[:end]})
                self.buf, self.state, self.skip_ws = self.buf[end + len(THINK_CLOSE):], "content", True
            elif self.state == "content":
                if self.reasoning and self.at_start and not self.held_ws:
                    head = self.buf.lstrip()
                    if head.startswith(THINK_OPEN):
                        self.buf, self.state = head[len(THINK_OPEN):], "reasoning"
                        continue
                    if THINK_OPEN.startswith(head):   # undecided (empty or a start of the tag)
                        break
                start = self.buf.find(CALL_OPEN) if self.parse else -1
                stray = self.buf.find(CALL_CLOSE) if self.parse and self.calls else -1
                if stray >= 0 and (start < 0 or stray < start):   # a closing tag after a call: dropped
                    self._content(out, self.buf[:stray])
                    self.buf, self.held_ws, self.skip_ws = self.buf[stray + len(CALL_CLOSE):], "", True
                    continue
                if start < 0:
                    keep = 0
                    if self.parse:
                        keep = max(partial_tail(self.buf, CALL_OPEN),
                                   partial_tail(self.buf, CALL_CLOSE) if self.calls else 0)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._content(out, self.buf[:start])
                self.held_ws, self.buf, self.state = "", self.buf[start + len(CALL_OPEN):], "tool"
            else:   # inside <tool_call>
                end = self.buf.find(CALL_CLOSE)
                if end < 0:
                    break
                block, self.buf, self.state = self.buf[:end], self.buf[end + len(CALL_CLOSE):], "content"
                self._call(out, block, closed=True)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what is still held back when the completion ends."""
        out: list[dict[str, Any]] = []
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            if rest:
                self._emit(out, {"reasoning_content": rest})
        elif self.state == "tool":   # an answer cut inside the closing tag: the block without its start
            cut = rest[:len(rest) - partial_tail(rest, CALL_CLOSE)]
            self._call(out, cut if cut != rest and self.parse(cut, self.functions) else rest, closed=False)
        else:
            self._content(out, rest)
        if self.held_ws and not self.calls:
            ws, self.held_ws = self.held_ws, ""
            self._emit(out, {"content": ws})
        return out

    # ---- results -----------------------------------------------------------------------------
    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the completion stopped by itself after calling tools."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def message(self) -> dict[str, Any]:
        """The assistant message the deltas so far add up to (call after `finish`)."""
        return assemble(self.deltas)


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Join OpenAI chat deltas into one message, the way a client joins a stream: content and
    reasoning concatenated, tool calls by index (arguments concatenated). content is null
    when there is none and the message calls tools."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        reasoning.append(delta.get("reasoning_content") or "")
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            function = part.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if any(reasoning):
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
        message["content"] = message["content"] or None
    return message
