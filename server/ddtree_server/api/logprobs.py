"""The `logprobs` objects of the OpenAI API from the engine's per-token logprobs
(engine/logprobs.py: the target's processed distribution at each emitted token).

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}``, one entry per emitted token;
* completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.

A token's text is its raw bytes (the grammar compiler's decoded vocabulary) decoded as UTF-8; a
byte piece of a character split over tokens is written as ``\\xNN`` escapes, as OpenAI's API writes
it (``"\\xe6\\x97"``), not as U+FFFD, so tokens stay apart; ``bytes`` (chat) carries the exact bytes,
so the character can be rebuilt.
"""

from __future__ import annotations

import codecs
from typing import Any, Sequence


class TokenTexts:
    """Raw bytes of every token id (from the engine's grammar compiler; built once)."""

    def __init__(self, engine: Any):
        self.vocab: list[bytes] = list(engine.grammars.info.decoded_vocab)

    def raw(self, token_id: int) -> bytes:
        return self.vocab[token_id] if 0 <= token_id < len(self.vocab) else b""

    def text(self, token_id: int) -> str:
        return token_text(self.raw(token_id))


def token_text(raw: bytes) -> str:
    """A token's text: UTF-8, its bytes outside a whole character as ``\\xNN`` escapes."""
    return raw.decode("utf-8", errors="backslashreplace")


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    raw = texts.raw(token_id)
    return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(texts: TokenTexts, entries: Sequence[Any]) -> dict[str, Any]:
    """The chat `choices[].logprobs` object (also of one stream chunk)."""
    content = []
    for e in entries:
        item = _entry(texts, e.token_id, e.logprob)
        item["top_logprobs"] = [_entry(texts, t, v) for t, v in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, entries: Sequence[Any], offset: int = 0) -> dict[str, Any]:
    """The completions `choices[].logprobs` object; ``offset``: characters of text before these
    tokens (a stream's earlier chunks), for ``text_offset``."""
    tokens, values, tops, offsets = [], [], [], []
    # offsets count characters of the decoded text, not of each token's own text: a character
    # split over tokens (byte pieces) sits at one index, which its tokens share
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for e in entries:
        tokens.append(texts.text(e.token_id))
        values.append(e.logprob)
        tops.append({texts.text(t): v for t, v in e.top})
        offsets.append(offset)
        offset += len(decoder.decode(texts.raw(e.token_id)))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
