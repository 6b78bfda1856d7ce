"""The completions `logprobs` object: text offsets into the decoded text (api/logprobs.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ddtree_server.api.logprobs import completion_logprobs


def test_completion_text_offsets_count_characters_of_the_decoded_text():
    """Tokens that are byte pieces of one character share its offset (they were 0, 1, 2 ...)."""
    raw = "日本、x".encode()            # 日 = e6 97 a5, 本 = e6 9c ac, 、= e3 80 81
    vocab = [raw[0:2], raw[2:4], raw[4:6], raw[6:9], raw[9:]]
    texts = SimpleNamespace(raw=lambda t: vocab[t], text=lambda t: vocab[t].decode("utf-8", errors="replace"))
    entries = [SimpleNamespace(token_id=i, logprob=-0.1, top=[]) for i in range(len(vocab))]
    got = completion_logprobs(texts, entries, offset=3)
    assert got["text_offset"] == [3, 3, 4, 5, 6]   # 日 from tokens 0-1, 本 from 1-2, then 、 and x
