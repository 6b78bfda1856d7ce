"""A byte table for byte-level BPE tokenizers: ``decode`` without a call into the tokenizer.

Streaming detokenisation decodes two short id lists per generated token (``stopping.py``); through
a Hugging Face tokenizer each call costs ~10-20 us, i.e. 1-2 ms per engine step at 64 running
requests, as much as the batched forward of a small target. For tokenizers whose decoder is
byte-level BPE (GPT-2's byte-to-unicode alphabet: Llama 3, Qwen, SmolLM2, ...), ``decode(ids,
skip_special_tokens=True)`` is the UTF-8 decoding (invalid bytes -> U+FFFD) of the concatenated
bytes of the ids, special tokens contributing nothing. ``byte_decoder`` builds that table once per
tokenizer, checks it against the tokenizer's own ``decode`` (every added token, a sample of the
vocabulary and of id sequences) and returns None, so that the caller keeps the tokenizer, whenever
the tokenizer is of another kind or any check differs.
"""

from __future__ import annotations

import random
import weakref
from typing import Callable

Decoder = Callable[[list[int]], str]
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NONE = object()
SAMPLE_IDS, SAMPLE_SEQS = 4096, 256


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    return decoder is not None and type(decoder).__name__ == "ByteLevel"


def _table(tokenizer) -> list[bytes] | None:
    alphabet = _byte_alphabet()
    size = len(tokenizer)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    table = []
    for i, tok in enumerate(tokens):
        if i in added:
            table.append(b"" if added[i].special else added[i].content.encode())
        elif tok is None:
            table.append(b"")
        else:
            try:
                table.append(bytes(alphabet[c] for c in tok))
            except KeyError:   # a character outside the byte alphabet: not byte-level after all
                return None
    return table


def _agrees(tokenizer, decode: Decoder, size: int, added) -> bool:
    rng = random.Random(0)
    ids = sorted(set(added) | set(rng.sample(range(size), min(size, SAMPLE_IDS))))
    checks = [[i] for i in ids] + [[rng.randrange(size) for _ in range(rng.randint(2, 12))] for _ in range(SAMPLE_SEQS)]
    return all(decode(c) == tokenizer.decode(c, skip_special_tokens=True, clean_up_tokenization_spaces=False)
               for c in checks)


def byte_decoder(tokenizer) -> Decoder | None:
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=True,
    clean_up_tokenization_spaces=False)`` from a byte table, or None (see the module docstring).
    Built once per tokenizer object (the first call checks it; ~0.1-1 s for a 150k vocabulary)."""
    try:
        cached = _TABLES.get(tokenizer)
    except TypeError:   # not weak-referenceable
        return None
    if cached is not None:
        return None if cached is _NONE else cached
    decode = None
    if _is_byte_level(tokenizer):
        table = _table(tokenizer)
        if table is not None:
            n = len(table)

            def decode(ids: list[int], table=table) -> str:   # ids past the vocabulary decode to nothing
                return b"".join([table[i] if i < n else b"" for i in ids]).decode("utf-8", "replace")
            if not _agrees(tokenizer, decode, len(table), getattr(tokenizer, "added_tokens_decoder", {}) or {}):
                decode = None
    _TABLES[tokenizer] = _NONE if decode is None else decode
    return decode
