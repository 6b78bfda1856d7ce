"""Schemathesis over the app's own OpenAPI document (GET /openapi.json), in-process (hostile input).

The real app, worker and Engine over a random tiny target (tests/server/api_tiny.py), with an API
key; schemathesis generates schema-valid and schema-violating requests for every operation and
checks that none is a 5xx, that every status, content type and JSON body is the one the document
declares, and that /v1/* refuse requests without the key. Bounded: a fixed seed, a fixed number
of examples per operation, no shrinking and a per-request deadline, so it takes seconds.

Not checked: `positive_data_acceptance` (a schema-valid request may still be a 400: context
length, tree budget over the limit) and `negative_data_rejection` (pydantic's lax mode
accepts `"5"` or `5.0` for an integer, as vLLM does).
"""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis.config import SchemathesisConfig

from tests.server.api_tiny import TinyApp

KEY = "sk-fuzz"
CONFIG = {
    "seed": 20240611,
    "generation": {"mode": "all", "max-examples": 40, "deterministic": True, "no-shrink": True,
                   "database": "none", "allow-x00": True},
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
    "checks": {"positive_data_acceptance": {"enabled": False}, "negative_data_rejection": {"enabled": False}},
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
