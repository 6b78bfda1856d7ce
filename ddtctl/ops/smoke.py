"""Smoke checks over the OpenAI API (httpx).

Every check is greedy (temperature 0) and short. Checks: the model is listed; a factual chat
answer contains the known fact; a multi-turn chat uses an earlier turn; a raw completion
continues the prompt (no chat-template markers); streamed == non-streamed; a tool-call round
trip and a json_schema answer (ops/smoke_tools.py); a stop sequence is
honoured (picked from the unconstrained output, so it works for any model); a bad request gets a
4xx, never a 5xx; for the bundled server with a drafter, the reported mean acceptance length is
above 1 ("n/a" in mode `ar`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from ddtctl import cancel
from ddtctl.errors import RemoteError, SmokeFailed
from ddtctl.inventory import Host
from ddtctl.ops import router as router_ops
from ddtctl.ops.readiness import AUTH_CODES, api_client, auth_error
from ddtctl.ops.checks import CheckFailed, expect
from ddtctl.ops.smoke_tools import json_schema_answer, tool_round_trip

FACT = ("What is the capital of France?", "paris")
MEMORY = ([{"role": "user", "content": "My name is Ada."},
           {"role": "assistant", "content": "Nice to meet you, Ada!"},
           {"role": "user", "content": "What is my name?"}], "ada")
RAW_PROMPT = "The capital of France is"
# Per-request timeouts (s): connecting through the forward is quick or not at all; one short
# greedy completion (<= 24 tokens) of a ready server answers well within READ.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0
TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "user:", "assistant:",
                    "<|start_header_id|>", "[INST]")




@dataclass
class Check:
    """One smoke check: status "pass" | "fail" | "n/a", a short detail, seconds taken."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class SmokeReport:
    host: str
    checks: list[Check] = field(default_factory=list)
    acceptance_length: float | None = None
    tokens_per_second: float | None = None
    interrupted: bool = False        # Ctrl-C: the remaining checks were not run

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict:
        return {"host": self.host, "ok": self.ok, "interrupted": self.interrupted,
                "acceptance_length": self.acceptance_length, "tokens_per_second": self.tokens_per_second,
                "checks": [c.__dict__ for c in self.checks]}


class _Api:
    def __init__(self, client: httpx.Client, host: Host):
        self.client, self.host, self.model = client, host, host.model_id

    def post(self, path: str, body: dict) -> httpx.Response:
        return self.client.post(path, json={"model": self.model, "temperature": 0, **body})

    def ok_json(self, path: str, body: dict) -> dict:
        r = self.post(path, body)
        if r.status_code in AUTH_CODES:
            raise auth_error(self.host, f"{path} {r.status_code}")
        if r.status_code != 200:
            raise CheckFailed(f"{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def chat(self, messages: list[dict], **kw) -> tuple[str, dict]:
        data = self.ok_json("/v1/chat/completions", {"messages": messages, **kw})
        return data["choices"][0]["message"]["content"] or "", data

    def complete(self, prompt: str, **kw) -> tuple[str, dict]:
        data = self.ok_json("/v1/completions", {"prompt": prompt, **kw})
        return data["choices"][0]["text"], data

    def chat_stream(self, messages: list[dict], **kw) -> str:
        parts, done = [], False
        body = {"model": self.model, "temperature": 0, "messages": messages, "stream": True, **kw}
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code in AUTH_CODES:
                raise auth_error(self.host, f"/v1/chat/completions {r.status_code}")
            if r.status_code != 200:
                raise CheckFailed(f"stream answered {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise CheckFailed(f"stream error event: {event['error']}")
                for choice in event.get("choices", []):
                    parts.append((choice.get("delta") or {}).get("content") or "")
        if not done:
            raise CheckFailed("stream ended without `data: [DONE]`")
        return "".join(parts)


def _run(report: SmokeReport, name: str, fn: Callable[[], str]) -> bool:
    """Run one check; False when the service could not be reached (connect error, timeout,
    dropped connection), so the caller can skip the rest instead of waiting on each."""
    start = time.monotonic()
    reached = True
    try:
        detail = fn()
        status = "n/a" if detail.startswith("n/a") else "pass"
    except (CheckFailed, httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as exc:
        status, detail = "fail", f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckFailed) else str(exc)
        reached = not isinstance(exc, httpx.TransportError)
    report.checks.append(Check(name, status, detail, round(time.monotonic() - start, 2)))
    return reached


def require_running(host: Host, manager) -> None:
    """Raise RemoteError (exit 1) saying to start the service when its manager says it is stopped
    or failed: no check could pass, so none is run. A service the manager does not know (never
    deployed by ddtctl) is probed as it is: something else may answer at its address."""
    state = manager.state()
    if not state.installed or state.active in ("active", "activating", "reloading", "deactivating", "unknown"):
        return
    raise RemoteError(f"{host.name}: smoke not run: {host.unit} is {state.describe()}; "
                      f"start it first: ddtctl start {host.name}")


def run_smoke(host: Host, transport, *, max_tokens: int = 24, manager=None) -> SmokeReport:
    """Run every check against `host`; never raises for a failed check (see `require_ok`).
    Raises AuthError (exit 3) when the API answers 401/403: no check could pass without the key;
    with `manager` (the service's), RemoteError first when the service is not running."""
    if manager is not None:
        require_running(host, manager)
    report = SmokeReport(host.name)
    with api_client(host, transport, timeout=READ_TIMEOUT_S, connect_timeout=CONNECT_TIMEOUT_S) as client:
        api = _Api(client, host)
        facts: dict = {}
        unreachable = ""

        def models() -> str:
            if host.service.kind == "router":         # its /v1/models says `unknown` (ops/router.py)
                verdicts = router_ops.workers(client, host)
                expect(all(v is True for v in verdicts.values()), router_ops.describe(verdicts))
                return f"{router_ops.describe(verdicts)}; {host.model_id} served by each"
            r = client.get("/v1/models")
            if r.status_code in AUTH_CODES:          # not a failed check: no check can pass (exit 3)
                raise auth_error(host, f"/v1/models {r.status_code}")
            expect(r.status_code == 200, f"/v1/models answered {r.status_code}: {r.text[:200]}")
            data = r.json().get("data") if isinstance(r.json(), dict) else None
            expect(isinstance(data, list), f"/v1/models has no `data` list: {r.text[:200]}")
            ids = [m.get("id") for m in data if isinstance(m, dict)]
            expect(host.model_id in ids, f"/v1/models lists {ids}, not {host.model_id!r}")
            return f"{host.model_id} listed"

        def fact() -> str:
            text, data = api.chat([{"role": "user", "content": FACT[0]}], max_tokens=max_tokens)
            facts["chat"], facts["decoding"] = text, data.get("decoding")
            expect(FACT[1] in text.lower(), f"answer lacks {FACT[1]!r}: {text!r}")
            return text.strip()[:60]

        def multi_turn() -> str:
            text, _ = api.chat(MEMORY[0], max_tokens=max_tokens)
            expect(MEMORY[1] in text.lower(), f"answer does not use the earlier turn: {text!r}")
            return text.strip()[:60]

        def raw() -> str:
            text, _ = api.complete(RAW_PROMPT, max_tokens=12)
            facts["raw"] = text
            expect(text.strip(), "empty continuation")
            bad = [m for m in TEMPLATE_MARKERS if m in text.lower() or m in text]
            expect(not bad, f"continuation contains chat-template markers {bad}: {text!r}")
            return repr(text.strip()[:50])

        def stream_equal() -> str:
            msgs = [{"role": "user", "content": FACT[0]}]
            plain, _ = api.chat(msgs, max_tokens=12)
            streamed = api.chat_stream(msgs, max_tokens=12)
            expect(plain == streamed, f"stream {streamed!r} != non-stream {plain!r}")
            return "identical"

        def stop() -> str:
            text = facts.get("raw") or api.complete(RAW_PROMPT, max_tokens=12)[0]
            picks = [(w, text.find(w)) for w in text.split()[1:]]
            picks = [(w, cut) for w, cut in picks if cut > 0 and text[:cut].strip()]
            expect(picks, f"continuation too short to pick a stop string: {text!r}")
            stop_at, cut = picks[0]
            got, data = api.complete(RAW_PROMPT, max_tokens=12, stop=[stop_at])
            reason = data["choices"][0]["finish_reason"]
            expect(stop_at not in got and got == text[:cut] and reason == "stop",
                   f"stop={stop_at!r}: got {got!r} finish_reason={reason!r}, expected {text[:cut]!r}")
            return f"stopped before {stop_at!r}"

        def bad_request() -> str:
            r = api.post("/v1/chat/completions", {"messages": [], "max_tokens": 4})
            expect(400 <= r.status_code < 500, f"empty messages answered {r.status_code}, expected 4xx")
            return f"{r.status_code}"

        def acceptance() -> str:
            if host.service.kind != "ddtree" and not (
                    host.service.kind == "router" and all(b.kind == "ddtree" for b in host.backends)):
                return "n/a (external engine)"
            dec = facts.get("decoding")
            expect(isinstance(dec, dict), "response has no `decoding` extension")
            report.acceptance_length = dec.get("mean_acceptance_length")
            report.tokens_per_second = dec.get("tokens_per_second")
            if dec.get("mode") == "ar":
                return "n/a (mode ar)"
            expect((report.acceptance_length or 0) > 1, f"mean acceptance length {report.acceptance_length}")
            return f"tau={report.acceptance_length:.2f} ({dec.get('mode')})"

        for name, fn in (("models", models), ("chat_fact", fact), ("multi_turn", multi_turn),
                         ("raw_completion", raw), ("stream_equal", stream_equal),
                         ("tool_call", lambda: tool_round_trip(api)), ("json_schema", lambda: json_schema_answer(api)),
                         ("stop_sequence", stop),
                         ("bad_request_4xx", bad_request), ("acceptance", acceptance)):
            if cancel.requested() or report.interrupted:
                report.interrupted = True
                report.checks.append(Check(name, "n/a", "not run: interrupted (Ctrl-C)"))
            elif unreachable:
                report.checks.append(Check(name, "fail", f"not run: {unreachable}"))
            elif not _run(report, name, fn):
                unreachable = f"service unreachable ({report.checks[-1].detail})"
    return report


def require_ok(report: SmokeReport) -> SmokeReport:
    """Raise SmokeFailed (exit 5) listing the failed checks, cancel.Interrupted (exit 130) when
    Ctrl-C stopped the checks."""
    if report.interrupted:
        done = sum(not c.detail.startswith("not run: interrupted") for c in report.checks)
        raise cancel.Interrupted(f"{report.host}: smoke interrupted (Ctrl-C) after {done} of "
                                 f"{len(report.checks)} checks")
    if not report.ok:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.status == "fail")
        raise SmokeFailed(f"{report.host}: smoke failed: {failed}")
    return report
