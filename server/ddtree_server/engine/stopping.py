"""StopChecker: EOS, stop token ids, stop strings and max_tokens, applied token by token.

Speculative rounds accept several tokens at once; this class looks at them one at a time so that
nothing after a stop is ever returned (docs/ddtree.md §2.7: the stop check includes the bonus
token).

Rules, per token in order:
1. EOS (unless ``ignore_eos``) or a ``stop_token_ids`` member: finish "stop"; the token itself is
   neither returned nor detokenised.
2. Otherwise the token is returned and detokenised incrementally (text is released only once it
   no longer ends in an incomplete UTF-8 sequence).
3. A stop string in the text: finish "stop"; text from the stop string on is removed. Text that
   could be the beginning of a stop string is held back until it is decided.
4. ``max_tokens`` returned tokens: finish "length".
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ddtree_server.engine import detok

_CONTEXT_TOKENS = 5  # prompt tokens used as detokenisation context (leading-space handling)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas (prefix/read-offset method)."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.fast = detok.byte_decoder(tokenizer)   # engine/detok.py: the same text without the tokenizer
        self.ids: list[int] = list(context_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self.fast is not None:
            return self.fast(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Text of tokens not released yet (incomplete sequences decode to U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopChecker:
    """Applies the stop rules of one request (see module docstring).

    Args:
        tokenizer: HF tokenizer (``decode``).
        max_tokens: >= 1 returned tokens at most.
        stop: stop strings; stop_token_ids: token ids that end generation.
        prompt_ids: the prompt (its last tokens are detokenisation context only).
    Attributes: ``finish_reason`` (None | "stop" | "length" | cancelled via ``finish``),
    ``token_ids`` and ``text`` returned so far.
    """

    def __init__(self, tokenizer, *, max_tokens: int, stop: Iterable[str] = (),
                 stop_token_ids: Iterable[int] = (), prompt_ids: Sequence[int] = ()):
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.stop_ids = set(int(t) for t in stop_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_ids)[-_CONTEXT_TOKENS:])
        self.pending = ""
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _held_back(self) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:k]):
                    best = k
                    break
        return best

    def _release(self, upto: int) -> str:
        out, self.pending = self.pending[:upto], self.pending[upto:]
        return out

    def feed(self, token_ids: Iterable[int]) -> tuple[list[int], str]:
        """Process accepted tokens in order; return (tokens returned, text delta).

        Stops consuming at the first stop condition; later tokens are dropped. Raises
        RuntimeError when called after the request finished.
        """
        if self.finished:
            raise RuntimeError("StopChecker.feed after finish")
        kept: list[int] = []
        text = ""
        for tok in token_ids:
            tok = int(tok)
            if tok in self.stop_ids:
                text += self._finish("stop")
                break
            kept.append(tok)
            self.pending += self.detok.add(tok)
            hit = self._find_stop()
            if hit is not None:
                text += self._release(hit)
                self.pending = ""
                self.finish_reason = "stop"
                break
            if len(self.token_ids) + len(kept) >= self.max_tokens:
                text += self._finish("length")
                break
            text += self._release(len(self.pending) - self._held_back())
        self.token_ids.extend(kept)
        self.text += text
        return kept, text

    def _find_stop(self) -> int | None:
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _finish(self, reason: str) -> str:
        self.pending += self.detok.flush()
        hit = self._find_stop()
        if hit is not None:  # the flushed tail completed a stop string
            self.pending = self.pending[:hit]
            reason = "stop"
        self.finish_reason = reason
        return self._release(len(self.pending))

    def finish(self, reason: str) -> str:
        """End the request from outside (e.g. "cancelled"); returns the remaining text to emit."""
        if self.finished:
            return ""
        text = self._finish(reason)
        self.text += text
        return text
