"""End-to-end: the official `openai` client against the real server process (SmolLM2, CPU, fp32)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.serverproc import API_KEY, MAX_MODEL_LEN, MODEL

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

FRANCE = "Complete this sentence: The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def decoding(obj) -> dict:
    """The `decoding` extension object of a response or chunk."""
    return obj.model_extra["decoding"]


def test_models_lists_served_name(api_client):
    models = api_client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert "ar" in models[0].model_extra["decoding"]["modes"]


def test_ready_and_sd_notify(api_server, api_notify):
    body = httpx.get(api_server.url("/ready")).json()
    assert body["state"] == "ready" and body["elapsed_s"] > 0
    assert any("READY=1" in m for m in api_notify.messages)
    assert any(m.startswith("STATUS=loading") for m in api_notify.messages)


def test_completion_continues_raw_prompt_france_regression(api_client):
    resp = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0)
    text = resp.choices[0].text
    assert "Paris" in text, text
    assert "user:" not in text.lower() and "<|im_start|>" not in text and "assistant" not in text.lower()
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.usage.prompt_tokens > 5 and resp.usage.completion_tokens <= 16
    stats = decoding(resp)
    assert stats["generated_tokens"] == resp.usage.completion_tokens
    for key in ("mode", "tree_budget", "block_size", "decode_rounds", "mean_acceptance_length", "tokens_per_second"):
        assert key in stats


def test_completion_token_id_prompts_equal_text_prompt(api_client, api_tokenizer):
    ids = api_tokenizer.encode(FRANCE)
    text = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=6, temperature=0)
    assert text.usage.prompt_tokens == len(ids)   # verbatim: no template, no system prompt
    for prompt in (ids, [ids], [FRANCE]):
        again = api_client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert again.choices[0].text == text.choices[0].text
        assert again.usage.prompt_tokens == len(ids)


def test_chat_uses_template_and_differs_from_raw(api_client):
    chat = api_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}],
                                              max_tokens=16, temperature=0)
    raw = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0)
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > raw.usage.prompt_tokens + 5   # template + system prompt
    assert message.content != raw.choices[0].text
    assert decoding(chat)["generated_tokens"] == chat.usage.completion_tokens


def test_stream_chat_with_usage_equals_non_stream(api_client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(api_client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    full = api_client.chat.completions.create(**kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert decoding(chunks[-1])["generated_tokens"] == full.usage.completion_tokens
    assert decoding(with_choices[-1])["mode"] == decoding(full)["mode"]


def test_stream_completion_equals_non_stream(api_client):
    kwargs = dict(model=MODEL, prompt=FRANCE, max_tokens=10, temperature=0)
    chunks = list(api_client.completions.create(stream=True, **kwargs))
    full = api_client.completions.create(**kwargs)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_raw_sse_framing(api_http):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    with api_http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all("usage" not in p for p in payloads)   # no include_usage: no usage key at all
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert payloads[-1]["decoding"]["generated_tokens"] >= 1


def test_stop_string_cuts_output(api_client):
    base = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0, stop=[stop, "zzzq"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[: base.index(stop)]
    streamed = list(api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0,
                                                  stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_max_tokens_one_is_length(api_client):
    resp = api_client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 1
    resp = api_client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=1, temperature=0)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 1


def test_seeded_sampling_is_reproducible(api_client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first = api_client.completions.create(**kwargs).choices[0].text
    assert api_client.completions.create(**kwargs).choices[0].text == first


def test_decoding_override_per_request(api_client):
    resp = api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0,
                                         extra_body={"decoding": {"mode": "ar"}})
    assert decoding(resp)["mode"] == "ar"
    modes = api_client.models.list().data[0].model_extra["decoding"]["modes"]
    missing = sorted({"dflash", "ddtree"} - set(modes))
    if missing:
        with pytest.raises(openai.BadRequestError) as info:
            api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4,
                                          extra_body={"decoding": {"mode": missing[0]}})
        assert info.value.body["param"] == "decoding.mode"


def test_api_key_required_on_v1_only(api_server):
    bad = openai.OpenAI(base_url=api_server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(api_server.url("/v1/models")).status_code == 401
    assert httpx.get(api_server.url("/health")).status_code == 200
    assert httpx.get(api_server.url("/ready")).status_code == 200
    ok = httpx.get(api_server.url("/v1/models"), headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_metrics_exposition(api_server, api_client):
    api_client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0)
    text = httpx.get(api_server.url("/metrics")).text
    for name in ("ddtree_requests_total", "ddtree_generated_tokens_total", "ddtree_acceptance_length_bucket",
                 "ddtree_queue_depth", "ddtree_decode_tokens_per_second_bucket", 'ddtree_server_state{'):
        assert name in text
    assert 'endpoint="/v1/completions",status="200"' in text


def test_speculative_modes_return_the_ar_text(api_client):
    """With the shipped drafter the server offers dflash/ddtree; at T=0 they return ar's exact text."""
    modes = api_client.models.list().data[0].model_extra["decoding"]["modes"]
    if "ddtree" not in modes:
        pytest.skip("no drafter loaded: only ar is served")
    kwargs = dict(model=MODEL, prompt=FRANCE, max_tokens=24, temperature=0)
    ref = api_client.completions.create(**kwargs, extra_body={"decoding": {"mode": "ar"}}).choices[0].text
    for override in ({"mode": "ddtree", "tree_budget": 8}, {"mode": "ddtree", "tree_budget": 32}, {"mode": "dflash"}):
        resp = api_client.completions.create(**kwargs, extra_body={"decoding": override})
        assert resp.choices[0].text == ref, override
        stats = decoding(resp)
        assert stats["mode"] == override["mode"] and stats["mean_acceptance_length"] >= 1.0
        streamed = "".join(c.choices[0].text for c in api_client.completions.create(
            **kwargs, stream=True, extra_body={"decoding": override}) if c.choices)
        assert streamed == ref, override
