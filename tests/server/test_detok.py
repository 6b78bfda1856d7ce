"""The byte-table decoder (engine/detok.py) gives the tokenizer's own text, and streams the same.

Real SmolLM2 tokenizer (byte-level BPE): random id sequences (special tokens, multi-byte characters
split across tokens, ids past the tokenizer's vocabulary), and a StopChecker with the table streams
exactly the deltas and stop decisions of one that calls the tokenizer. A tokenizer of another kind
keeps the tokenizer.
"""

from __future__ import annotations

import random

import pytest
from ddtree_server.engine import detok
from ddtree_server.engine.stopping import StopChecker

from tests.server.api_fixtures import api_tokenizer  # noqa: F401 - session fixture
from tests.server.tiny import ByteTokenizer

pytestmark = pytest.mark.slow


def _hf(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_table_equals_tokenizer_decode(api_tokenizer):  # noqa: F811
    fast = detok.byte_decoder(api_tokenizer)
    assert fast is not None and detok.byte_decoder(api_tokenizer) is fast      # built once
    rng = random.Random(7)
    text = "naïve café 你好 🙂 <|im_start|>user\nx<|im_end|> \u00a0\t end"
    pieces = api_tokenizer(text)["input_ids"]
    special = sorted(api_tokenizer.all_special_ids)
    cases = [pieces, pieces[:3], pieces[3:], [len(api_tokenizer) + 5, *pieces]]
    for _ in range(2000):
        pool = rng.choice([range(len(api_tokenizer)), pieces + special])
        cases.append([rng.choice(pool) for _ in range(rng.randint(1, 16))])
    for ids in cases:
        assert fast(ids) == _hf(api_tokenizer, ids), ids


def test_streaming_with_the_table_equals_the_tokenizer(api_tokenizer, monkeypatch):  # noqa: F811
    rng = random.Random(3)
    emoji = api_tokenizer("🙂 你好 é")["input_ids"]   # multi-byte characters split over tokens
    for trial in range(60):
        ids = [rng.choice(emoji) if rng.random() < 0.4 else rng.randrange(len(api_tokenizer)) for _ in range(40)]
        stop = [rng.choice(["好", "e", " the", "zz"])] if trial % 2 else []
        kw = dict(max_tokens=rng.randint(5, 40), stop=stop, prompt_ids=emoji[:3])
        fast = StopChecker(api_tokenizer, **kw)
        with monkeypatch.context() as m:
            m.setattr(detok, "byte_decoder", lambda tok: None)
            slow = StopChecker(api_tokenizer, **kw)
        assert fast.detok.fast is not None and slow.detok.fast is None
        pos = 0
        while pos < len(ids) and not fast.finished:
            k = rng.randint(1, 5)
            assert fast.feed(ids[pos:pos + k]) == slow.feed(ids[pos:pos + k])
            pos += k
        assert (fast.text, fast.finish_reason, fast.token_ids) == (slow.text, slow.finish_reason, slow.token_ids)


def test_other_tokenizers_keep_their_decode():
    assert detok.byte_decoder(ByteTokenizer()) is None
