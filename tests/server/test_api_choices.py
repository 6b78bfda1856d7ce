"""`n > 1`: n choices of one prompt, generated as n requests of the same batch (real Engine,
Worker and app on the tiny target). Greedy choices are identical; seeded sampled choices use
seed + i, so choice i equals a single request with that seed; a stream carries every choice's
chunks with its index and ends with [DONE]."""

from __future__ import annotations

import json

import pytest

from tests.server.api_tiny import TinyApp


@pytest.fixture(scope="module")
def tiny():
    app = TinyApp()
    yield app
    app.stop()


def _completion(tiny, **body):
    response = tiny.request("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 6, **body})
    assert response.status_code == 200, response.text
    return response


def test_greedy_choices_are_identical(tiny):
    body = _completion(tiny, n=3, temperature=0).json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert texts == [_completion(tiny, temperature=0).json()["choices"][0]["text"]] * 3
    assert body["usage"]["completion_tokens"] == sum(1 for _ in range(3)) * body["decoding"]["generated_tokens"]


def test_seeded_choice_i_equals_seed_plus_i(tiny):
    body = _completion(tiny, n=4, temperature=1.0, seed=40).json()
    for i, choice in enumerate(body["choices"]):
        alone = _completion(tiny, temperature=1.0, seed=40 + i).json()["choices"][0]["text"]
        assert choice["text"] == alone, i


def test_stream_carries_every_choice(tiny):
    response = _completion(tiny, n=3, temperature=1.0, seed=7, stream=True,
                           stream_options={"include_usage": True})
    assert response.text.endswith("data: [DONE]\n\n")
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    texts, finished = ["", "", ""], set()
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert finished == {0, 1, 2}
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    whole = _completion(tiny, n=3, temperature=1.0, seed=7).json()
    assert texts == [c["text"] for c in whole["choices"]]


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400(tiny, n):
    response = tiny.request("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "n": n})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text
