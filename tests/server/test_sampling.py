"""SamplingParams validation, temperature / top-p processing and seeded token choice."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.sampling import SamplingParams, TokenChooser, processed_probs


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=1, temperature=-1.0),
                                    dict(max_tokens=1, top_p=0.0), dict(max_tokens=1, top_p=1.5),
                                    dict(max_tokens=1, stop=[""])])
def test_invalid_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_greedy_flag():
    assert SamplingParams(max_tokens=1).greedy
    assert not SamplingParams(max_tokens=1, temperature=0.5).greedy


def test_temperature_only():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    got = processed_probs(logits, 0.5, 1.0)
    assert torch.allclose(got, torch.softmax(logits / 0.5, -1))


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    got = processed_probs(logits, 1.0, 0.8)      # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    got = processed_probs(logits, 1.0, 0.81)     # needs the third token
    assert torch.allclose(got, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    got = processed_probs(logits, 1.0, 0.1)      # always at least the top token
    assert torch.allclose(got, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_top_p_rows_independent_and_unsorted_vocab():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    got = processed_probs(logits, 1.0, 0.7)
    assert got[0, 1] > 0 and got[0, 0] == 0
    assert got[1, 0] > 0
    assert torch.allclose(got.sum(-1), torch.ones(2))


def test_greedy_choice_is_argmax():
    ch = TokenChooser(SamplingParams(max_tokens=1), "cpu")
    assert ch.choose(torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0]])) == [1, 0]


def test_seeded_sampling_reproducible_and_distributed():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]])).expand(20000, 3)
    a = TokenChooser(SamplingParams(max_tokens=1, temperature=1.0, seed=7), "cpu").choose(logits)
    b = TokenChooser(SamplingParams(max_tokens=1, temperature=1.0, seed=7), "cpu").choose(logits)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=3).float() / len(a)
    assert torch.allclose(freq, torch.tensor([0.2, 0.5, 0.3]), atol=0.02)
