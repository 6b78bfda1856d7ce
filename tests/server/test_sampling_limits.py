"""Extreme sampling values by class: the sampler never sees a NaN and never raises.

* temperatures that under- or overflow fp32 (5e-324, denormals, anything below 1e-5) are greedy;
* temperatures >= 1e-5 sample from finite probabilities whatever the logit magnitude;
* huge finite temperatures give a (near) uniform distribution, non-finite ones are refused;
* a top_p that rounds to 0 in fp32 keeps exactly the most probable token.
"""

from __future__ import annotations

import sys

import pytest
import torch

from ddtree_server.engine import sampling
from ddtree_server.engine.sampling import SamplingParams, TokenChooser, processed_probs

GREEDY_TEMPERATURE = 1e-5   # documented threshold (vLLM's _SAMPLING_EPS)

LOGITS = torch.tensor([[-3.0, 12.0, 7.0, float("-inf")], [9.0, 0.5, 9.5, -1.0]])
ARGMAX = [1, 2]
TINY = [0.0, -0.0, 5e-324, sys.float_info.min, 1e-45, 1e-39, 1e-38, 1e-30, 1e-6, GREEDY_TEMPERATURE * 0.999]


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_are_greedy(temperature):
    params = SamplingParams(max_tokens=1, temperature=temperature, seed=1)
    assert params.greedy
    assert TokenChooser(params, "cpu").choose(LOGITS) == ARGMAX


@pytest.mark.parametrize("temperature", [GREEDY_TEMPERATURE, 1e-4, 1e-2, 0.5, 2.0])
@pytest.mark.parametrize("scale", [1.0, 1e4, 1e30, 3e38])
def test_small_temperatures_sample_from_finite_probabilities(temperature, scale):
    logits = torch.tensor([[-1.0, 1.0, 0.5, float("-inf")], [0.0, -1.0, 0.25, -0.5]]) * scale
    probs = processed_probs(logits, temperature, 1.0)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2))
    chooser = TokenChooser(SamplingParams(max_tokens=1, temperature=temperature, seed=3), "cpu")
    assert not chooser.params.greedy
    got = chooser.choose(logits)
    if temperature <= 1e-2 and scale >= 1e4:   # the distribution is one-hot at these scales
        assert got == [1, 2]


@pytest.mark.parametrize("temperature", [1e38, 1e308, sys.float_info.max])
def test_huge_temperatures_are_uniform_not_nan(temperature):
    probs = processed_probs(LOGITS, temperature, 1.0)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs[0, :3], torch.full((3,), 1 / 3)) and probs[0, 3] == 0   # -inf stays excluded
    assert torch.allclose(probs[1], torch.full((4,), 0.25))
    TokenChooser(SamplingParams(max_tokens=1, temperature=temperature, seed=0), "cpu").choose(LOGITS)


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-300, -5e-324])
def test_non_finite_or_negative_temperatures_are_refused(temperature):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(max_tokens=1, temperature=temperature)


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-39, 1e-300, 1e-9])
@pytest.mark.parametrize("temperature", [1e-5, 1.0, 2.0])
def test_tiny_top_p_keeps_the_most_probable_token(top_p, temperature):
    probs = processed_probs(LOGITS, temperature, top_p)
    expected = torch.zeros_like(probs)
    expected[0, 1] = expected[1, 2] = 1.0
    assert torch.equal(probs, expected)
    chooser = TokenChooser(SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, seed=5), "cpu")
    assert chooser.choose(LOGITS.expand(2, 4)) == ARGMAX


@pytest.mark.parametrize("top_p", [0.0, -0.0, -5e-324, 1.0000001, float("nan"), float("inf")])
def test_top_p_outside_its_range_is_refused(top_p):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p)


def test_greedy_threshold_is_the_documented_one():
    assert getattr(sampling, "GREEDY_TEMPERATURE", None) == GREEDY_TEMPERATURE
    assert not SamplingParams(max_tokens=1, temperature=GREEDY_TEMPERATURE).greedy
