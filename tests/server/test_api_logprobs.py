"""The completions `logprobs` object: text offsets into the decoded text (api/logprobs.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ddtree_server.api.logprobs import chat_logprobs, completion_logprobs, token_text


def test_completion_text_offsets_count_characters_of_the_decoded_text():
    """Tokens that are byte pieces of one character share its offset (they were 0, 1, 2 ...)."""
    raw = "日本、x".encode()            # 日 = e6 97 a5, 本 = e6 9c ac, 、= e3 80 81
    vocab = [raw[0:2], raw[2:4], raw[4:6], raw[6:9], raw[9:]]
    texts = SimpleNamespace(raw=lambda t: vocab[t], text=lambda t: token_text(vocab[t]))
    entries = [SimpleNamespace(token_id=i, logprob=-0.1, top=[]) for i in range(len(vocab))]
    got = completion_logprobs(texts, entries, offset=3)
    assert got["text_offset"] == [3, 3, 4, 5, 6]   # 日 from tokens 0-1, 本 from 1-2, then 、 and x


def test_byte_pieces_are_escaped_as_openai_writes_them_not_replaced():
    """A token holding part of a character reads ``\\xe6\\x97`` (OpenAI's form), so two different pieces
    stay two different top_logprobs keys (as U+FFFD they collided into one); chat keeps the bytes."""
    raw = "日本".encode()
    vocab = [raw[0:2], raw[0:1], raw[2:3], "x".encode()]
    texts = SimpleNamespace(raw=lambda t: vocab[t], text=lambda t: token_text(vocab[t]))
    entries = [SimpleNamespace(token_id=0, logprob=-0.1, top=[(0, -0.1), (1, -2.0), (3, -3.0)])]
    got = completion_logprobs(texts, entries)
    assert got["tokens"] == ["\\xe6\\x97"] and got["top_logprobs"] == [{"\\xe6\\x97": -0.1, "\\xe6": -2.0, "x": -3.0}]
    chat = chat_logprobs(texts, entries)["content"][0]
    assert chat["token"] == "\\xe6\\x97" and bytes(chat["bytes"]) == raw[0:2]
    assert [t["token"] for t in chat["top_logprobs"]] == ["\\xe6\\x97", "\\xe6", "x"]
    assert token_text("é".encode()) == "é"   # whole characters stay as they are
