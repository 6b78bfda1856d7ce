"""Schemathesis over the app's own OpenAPI document (GET /openapi.json), in-process (hostile input).

The real app, worker and Engine over a random tiny target (tests/server/api_tiny.py), with an API
key; schemathesis generates schema-valid and schema-violating requests for every operation and
checks that none is a 5xx, that every status, content type and JSON body is the one the document
declares, that a request the document forbids is refused (`negative_data_rejection`: the request
models are strict, so `false` is no number and `"5"` no integer), and that /v1/* refuse requests
without the key. Bounded: a fixed seed, a fixed number of examples per operation, no shrinking and
a per-request deadline, so it takes seconds.

Not checked: `positive_data_acceptance` (a schema-valid request may still be a 400 decided at run
time: context length, another model's name, n > 1, a parameter refused unless neutral).
"""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig

from tests.server.api_tiny import TinyApp

KEY = "sk-fuzz"
CONFIG = {
    "seed": 20240611,
    "generation": {"mode": "all", "max-examples": 20, "deterministic": True, "no-shrink": True,
                   "database": "none", "allow-x00": True},
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
    "checks": {"positive_data_acceptance": {"enabled": False}},
    "request-timeout": 30,
    "headers": {"Authorization": f"Bearer {KEY}"},
}


@pytest.fixture(scope="module")
def fuzz_app():
    tiny = TinyApp(start=False, api_key=KEY)   # the app's lifespan (started by schemathesis) starts the worker
    yield tiny
    tiny.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app.app,
                                            config=SchemathesisConfig.from_dict(CONFIG))
    fuzz_app.wait_ready()
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_app_conforms_to_its_openapi_document(case, fuzz_app):
    case.call_and_validate(timeout=30)


def test_document_declares_what_the_app_answers(api_schema, fuzz_app):
    raw = fuzz_app.request("GET", "/openapi.json").json()
    paths = raw["paths"]
    assert {"/health", "/ready", "/metrics", "/v1/models", "/v1/models/{model_id}", "/v1/chat/completions",
            "/v1/completions"} <= set(paths)
    completions = paths["/v1/completions"]["post"]
    assert "422" not in completions["responses"] and {"200", "400", "401", "413", "429", "503"} <= set(
        completions["responses"])
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["security"] == [{"bearer": []}] and "security" not in paths["/health"]["get"]
    assert raw["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": False},
     "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "echo": 0}, "echo"),
])
def test_values_the_document_forbids_are_refused(fuzz_app, api_schema, path, body, param):
    response = fuzz_app.request("POST", path, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_document_states_the_limits_the_server_applies(fuzz_app, api_schema):
    schemas = fuzz_app.request("GET", "/openapi.json").json()["components"]["schemas"]
    budget = schemas["DecodingOverride"]["properties"]["tree_budget"]["anyOf"][0]
    assert budget["maximum"] == fuzz_app.config.tree_budget_limit   # not the 4096 of the flag's range
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt   # "" is refused, and the document says so
    for name in ("frequency_penalty", "presence_penalty", "temperature", "top_p"):
        assert schemas["ChatCompletionRequest"]["properties"][name]["anyOf"][0]["type"] == "number"
