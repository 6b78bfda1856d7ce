"""RequestProcessor: each tree node's row is the row plain decoding would process after that
node's path, and processing a tree leaves the committed state untouched.

Random logits, random trees, the byte tokenizer with a JSON grammar, penalties and a logit bias
together: the processed row of node i must equal the row a fresh processor gives after
committing the path of i and processing a one-node tree (what ``ar`` does).
"""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_server.constrained.compiler import GrammarCompiler
from ddtree_server.engine.processors import RequestProcessor
from ddtree_server.engine.sampling import SamplingParams
from tests.server.tiny import EOS, VOCAB, ByteTokenizer

PROMPT = list(b"<user>json<assistant>")
COMMITTED = list(b'{"a": [1, 2')


@pytest.fixture(scope="module")
def grammar():
    return GrammarCompiler(ByteTokenizer(), VOCAB, [EOS]).json_object()


def _params(grammar, **kw):
    return SamplingParams(max_tokens=8, grammar=grammar, presence_penalty=0.4, frequency_penalty=0.6,
                          repetition_penalty=1.4, logit_bias={ord("3"): 2.0, ord("]"): -1.5}, **kw)


def _tree(rng: random.Random, root: int, n: int, alphabet: bytes) -> tuple[list[int], list[int]]:
    parents, tokens = [-1], [root]
    for i in range(1, n):
        parents.append(rng.randrange(i))
        tokens.append(rng.choice(alphabet))
    return parents, tokens


def _fresh(grammar, path_tokens):
    proc = RequestProcessor(_params(grammar), PROMPT, VOCAB, "cpu")
    proc.commit(COMMITTED + path_tokens)
    return proc


@pytest.mark.parametrize("seed", range(4))
def test_rows_equal_sequential_processing(grammar, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    proc = _fresh(grammar, [])
    parents, tokens = _tree(rng, COMMITTED[-1], 24, b"0123456789, ]}x\"")
    logits = torch.randn(len(parents), VOCAB, generator=g) * 3
    out = proc.process(logits, parents, tokens)
    assert not torch.equal(out, logits)
    reachable = [True] * len(parents)
    for i in range(1, len(parents)):
        p = parents[i]
        reachable[i] = reachable[p] and bool(torch.isfinite(out[p, tokens[i]]))
    checked = 0
    for i in range(len(parents)):
        if not reachable[i]:
            continue   # a path the grammar refuses: no decode loop can emit it
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        seq = _fresh(grammar, path[::-1])
        expect = seq.process(logits[i:i + 1], [-1], [tokens[i]])[0]
        assert torch.equal(out[i], expect), f"node {i}"
        checked += 1
    assert checked >= 3
    again = proc.process(logits, parents, tokens)   # the committed state did not move
    assert torch.equal(again, out)


def test_refused_rows_stay_samplable(grammar):
    proc = _fresh(grammar, [])
    parents, tokens = [-1, 0, 1], [COMMITTED[-1], ord("x"), ord("y")]   # "x" is refused after '{"a": [1, 2'
    out = proc.process(torch.zeros(3, VOCAB), parents, tokens)
    assert not torch.isfinite(out[0, ord("x")])
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[2]).all()


def test_inactive_processor_is_the_fast_path():
    proc = RequestProcessor(SamplingParams(max_tokens=4), PROMPT, VOCAB, "cpu")
    logits = torch.randn(3, VOCAB)
    assert not proc.active and not proc.wants_logprobs
    assert proc.process(logits, [-1, 0, 0], [1, 2, 3]) is logits
    assert proc.take_logprobs() is None


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0.0), dict(logit_bias={5: 101.0}),
                                 dict(logit_bias={-1: 1.0}), dict(logprobs=21)])
def test_sampling_params_ranges(bad):
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, **bad)


def test_logit_bias_outside_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        RequestProcessor(SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0}), PROMPT, VOCAB, "cpu")
