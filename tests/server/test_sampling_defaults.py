"""Sampling defaults from the model (engine/defaults.py) and top-k (engine/sampling.py), as units."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_server.api.prompts import sampling_params
from ddtree_server.api.schemas import ChatCompletionRequest, CompletionRequest
from ddtree_server.engine.defaults import EMBEDDED_DEFAULTS, from_generation_config, sampling_defaults
from ddtree_server.engine.params import SamplingParams
from ddtree_server.engine.sampling import processed_probs


def test_top_k_keeps_the_k_most_probable_then_top_p():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    probs = processed_probs(logits, 1.0, 1.0, top_k=2)
    assert torch.allclose(probs, torch.tensor([[0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7, 0.0]]))
    assert torch.equal(processed_probs(logits, 1.0, 0.5, top_k=3) > 0, torch.tensor([[False, True, False, True, False]]))
    assert torch.allclose(processed_probs(logits, 1.0, 1.0, top_k=0), processed_probs(logits, 1.0, 1.0))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=1, top_k=-1)


def write(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_values_and_bad_ones(tmp_path):
    folder = write(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    assert from_generation_config(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    write(tmp_path, {"temperature": "hot", "top_p": 0, "top_k": 0, "eos_token_id": 2})
    assert from_generation_config(folder) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert from_generation_config(folder) == {} and from_generation_config(None) == {}
    assert sampling_defaults(tmp_path / "missing", embedded=True) == EMBEDDED_DEFAULTS


def test_request_values_win_over_model_defaults():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    params = sampling_params(chat, 5, 100, SamplingParams, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    explicit = CompletionRequest(prompt="x", temperature=0, top_p=0.5, top_k=-1)
    params = sampling_params(explicit, 5, 100, SamplingParams, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.5, 0)
    bare = sampling_params(chat, 5, 100, SamplingParams, None)
    assert (bare.temperature, bare.top_p, bare.top_k) == (1.0, 1.0, 0)
