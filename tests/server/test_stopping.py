"""StopChecker: EOS, stop ids, stop strings (held back, removed), max_tokens, UTF-8 pieces."""

from __future__ import annotations

import pytest

from ddtree_server.engine.stopping import StopChecker


class CharTokenizer:
    """A tiny real tokenizer for tests: one token per UTF-8 byte (ids 0..255), 256 = EOS."""

    eos_token_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")


TOK = CharTokenizer()


def run(chunks, **kw):
    kw.setdefault("max_tokens", 1000)
    sc = StopChecker(TOK, **kw)
    ids, text = [], ""
    for chunk in chunks:
        got_ids, got_text = sc.feed(chunk)
        ids += got_ids
        text += got_text
        if sc.finished:
            break
    else:
        text += sc.finish("cancelled")
    return ids, text, sc


def test_eos_not_returned_and_rest_dropped():
    ids, text, sc = run([TOK.encode("ab") + [256] + TOK.encode("cd")], stop_token_ids=[256])
    assert ids == TOK.encode("ab") and text == "ab" and sc.finish_reason == "stop"


def test_max_tokens_exact():
    ids, text, sc = run([TOK.encode("abcdef")], max_tokens=4)
    assert ids == TOK.encode("abcd") and text == "abcd" and sc.finish_reason == "length"


def test_stop_string_removed_across_rounds():
    ids, text, sc = run([TOK.encode("hello wo"), TOK.encode("rld! more")], stop=["world"])
    assert text == "hello " and sc.finish_reason == "stop"
    assert TOK.decode(ids) == "hello world"  # tokens up to the one completing the stop string


def test_held_back_text_is_released_when_not_a_stop():
    sc = StopChecker(TOK, max_tokens=100, stop=["abc"])
    _, t1 = sc.feed(TOK.encode("xxab"))
    assert t1 == "xx"
    _, t2 = sc.feed(TOK.encode("d"))
    assert t2 == "abd"


def test_held_back_text_flushed_at_length_and_eos():
    ids, text, sc = run([TOK.encode("xab")], stop=["abc"], max_tokens=3)
    assert text == "xab" and sc.finish_reason == "length"
    ids, text, sc = run([TOK.encode("xab") + [256]], stop=["abc"], stop_token_ids=[256])
    assert text == "xab" and sc.finish_reason == "stop"


def test_earliest_stop_string_wins():
    ids, text, sc = run([TOK.encode("one two three")], stop=["three", "two"])
    assert text == "one " and sc.finish_reason == "stop"


def test_utf8_split_over_tokens():
    data = "é😀x".encode("utf-8")
    sc = StopChecker(TOK, max_tokens=100)
    texts = [sc.feed([b])[1] for b in data]
    assert "".join(texts) == "é😀x"
    assert all("\ufffd" not in t for t in texts)


def test_cancel_flushes_and_feed_after_finish_raises():
    ids, text, sc = run([TOK.encode("abc")], stop=["zz"])
    assert sc.finish_reason == "cancelled" and text == "abc"
    with pytest.raises(RuntimeError):
        sc.feed([1])


def test_event_text_concatenation_equals_total():
    chunks = [TOK.encode(p) for p in ["The ans", "wer is ", "42.\n\nUs", "er: again"]]
    ids, text, sc = run(chunks, stop=["\n\nUser:"])
    assert text == "The answer is 42." and sc.text == text


@pytest.mark.slow
def test_real_tokenizer_roundtrip(smollm2):
    tok = smollm2.tokenizer
    s = "Hello world! Ça va? 你好 😀 done"
    ids = tok.encode(s, add_special_tokens=False)
    sc = StopChecker(tok, max_tokens=100, stop=["done"], stop_token_ids=[tok.eos_token_id])
    text = "".join(sc.feed([i])[1] for i in ids if not sc.finished)
    assert text == "Hello world! Ça va? 你好 😀 " and sc.finish_reason == "stop"
