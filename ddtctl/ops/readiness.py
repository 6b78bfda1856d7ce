"""wait-ready: poll until a service is really serving, or fail fast with the reason.

One round = service manager state (fail fast on `failed`, start-limit-hit or a growing restart
count, with the last log lines; an HTTP 401/403 fails at once as AuthError, exit 3) + engine health (`/ready` for the bundled server, `/health` for
SGLang/vLLM, `/readiness` for a router) + `/v1/models` lists the expected id (a router: its
`/workers` has a healthy backend, ops/router.py) + a 1-token completion. Ready after K
consecutive good rounds. Between failed rounds: exponential backoff (1 s -> 10 s) with jitter;
`$DDTCTL_READY_POLL_MAX_S` lowers the 10 s (the test suite: servers that start in seconds).
HTTP goes through `transport.forward(address, port)` with httpx (read timeout 30 s: SGLang's
health check alone may take 20 s under load).
"""

from __future__ import annotations

import contextlib
import html
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from ddtctl import cancel
from ddtctl.errors import AuthError, ReadinessTimeout, RemoteError
from ddtctl.inventory import Host
from ddtctl.ops import logcause
from ddtctl.ops import router as router_ops

READ_TIMEOUT_S = 30.0
MAX_POLL_INTERVAL_S = 10.0
POLL_MAX_ENV = "DDTCTL_READY_POLL_MAX_S"
AUTH_CODES = (401, 403)   # the API refused our credentials: an answer, not a state to wait out


def health_path(host: Host) -> str:
    return {"ddtree": "/ready", "router": "/readiness"}.get(host.service.kind, "/health")


def auth_error(host: Host, detail: str) -> AuthError:
    """AuthError (exit 3) for an HTTP 401/403 from `host`'s API, naming the variable to set."""
    name = host.service.api_key_env
    if not name:
        fix = "the server wants an API key: name the variable holding it in the inventory (service.api_key_env)"
    elif not os.environ.get(name):
        fix = f"the server wants an API key and ${name} (service.api_key_env) is not set here"
    else:
        fix = f"the server refused the API key in ${name} (service.api_key_env)"
    return AuthError(f"{host.name}: authentication failed: {detail}: {fix}")


def auth_headers(host: Host) -> dict[str, str]:
    """Bearer header from the env var named by `api_key_env` (empty when unset)."""
    name = host.service.api_key_env
    key = os.environ.get(name) if name else None
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextlib.contextmanager
def api_client(host: Host, transport, *, timeout: float = READ_TIMEOUT_S,
               connect_timeout: float = 5.0) -> Iterator[httpx.Client]:
    """An httpx client for the service's HTTP API, reached through the transport's forward."""
    with transport.forward(host.address, host.service.port) as (addr, port):
        base = f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}"
        with httpx.Client(base_url=base, headers=auth_headers(host),
                          timeout=httpx.Timeout(timeout, connect=connect_timeout)) as client:
            yield client


@dataclass
class Probe:
    """One readiness round: ok, or the first thing that was not ready yet."""

    ok: bool
    step: str            # "unit" | "health" | "models" | "backends" | "completion" | "auth" | "ready"
    detail: str
    models: list[str] = field(default_factory=list)


def probe_http(client: httpx.Client, host: Host) -> Probe:
    """health -> /v1/models -> 1-token completion, stopping at the first step that is not ready.
    A 401/403 anywhere is Probe(step="auth"): waiting longer cannot fix it (see auth_error)."""
    try:
        r = client.get(health_path(host))
        if r.status_code in AUTH_CODES:
            return Probe(False, "auth", f"{health_path(host)} {r.status_code} {brief_body(r)}")
        if r.status_code != 200:
            return Probe(False, "health", f"{health_path(host)} {r.status_code} {brief_body(r)}")
        if host.service.kind == "router":          # its /v1/models says `unknown`: see ops/router.py
            verdicts = router_ops.workers(client, host)
            if not any(v is True for v in verdicts.values()):
                return Probe(False, "backends", router_ops.describe(verdicts))
            return _completion(client, host, [host.model_id], router_ops.describe(verdicts))
        r = client.get("/v1/models")
        if r.status_code in AUTH_CODES:
            return Probe(False, "auth", f"/v1/models {r.status_code} {brief_body(r)}")
        if r.status_code != 200:
            return Probe(False, "models", f"/v1/models {r.status_code} {brief_body(r)}")
        ids = [m.get("id") for m in r.json().get("data", [])]
        if host.model_id not in ids:
            return Probe(False, "models", f"/v1/models lists {ids}, not {host.model_id!r}", ids)
        return _completion(client, host, ids)
    except httpx.ConnectError:
        return Probe(False, "health", "connection refused (booting)")
    except httpx.TimeoutException:
        return Probe(False, "health", "timed out (busy or hung)")
    except (httpx.HTTPError, ValueError) as exc:
        return Probe(False, "health", f"{type(exc).__name__}: {exc}")


def _completion(client: httpx.Client, host: Host, ids: list[str], ready: str = "ready") -> Probe:
    """The round's last step: a 1-token completion of the model id (through a router: by a backend)."""
    r = client.post("/v1/completions", json={"model": host.model_id, "prompt": "Hello",
                                              "max_tokens": 1, "temperature": 0})
    if r.status_code in AUTH_CODES:
        return Probe(False, "auth", f"/v1/completions {r.status_code} {brief_body(r)}", ids)
    if r.status_code != 200:
        return Probe(False, "completion", f"1-token completion {r.status_code} {brief_body(r)}", ids)
    reason = (r.json().get("choices") or [{}])[0].get("finish_reason")
    if reason not in ("length", "stop"):
        return Probe(False, "completion", f"1-token completion finish_reason={reason!r}", ids)
    return Probe(True, "ready", ready, ids)


def brief_body(resp: httpx.Response) -> str:
    """A response body in a few words: the JSON state or error message; an HTML error page (a
    proxy's or a framework's) as `HTML page "<title>"`, never the page; other text: its first
    120 characters on one line."""
    try:
        body = resp.json()
    except ValueError:
        text = resp.text
        if "html" in resp.headers.get("content-type", "").lower() or text.lstrip()[:15].lower().startswith(
                ("<!doctype html", "<html")):
            title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
            words = " ".join(html.unescape(title.group(1)).split())[:80] if title else ""
            return f'HTML page "{words}" ({len(resp.content)} bytes)' if words else f"HTML page ({len(resp.content)} bytes)"
        return " ".join(text[:120].split())
    if isinstance(body, dict) and "state" in body:
        return f"state={body['state']}" + (f" ({body['detail']})" if body.get("detail") else "")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:160]
    return str(body)[:160]


@dataclass
class ReadyReport:
    host: str
    ready: bool
    seconds: float
    rounds: int
    models: list[str]
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def max_poll_interval(environ=os.environ) -> float:
    """The longest wait between failed rounds: $DDTCTL_READY_POLL_MAX_S when it is a number from
    1 to 10, else 10 s."""
    try:
        value = float(environ.get(POLL_MAX_ENV, ""))
    except ValueError:
        return MAX_POLL_INTERVAL_S
    return value if 1.0 <= value <= MAX_POLL_INTERVAL_S else MAX_POLL_INTERVAL_S


def wait_ready(host: Host, transport, manager, *, timeout_s: float | None = None, consecutive: int = 2,
               max_interval_s: float | None = None, on_round: Callable[[Probe], None] | None = None,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
               ) -> ReadyReport:
    """Block until `host` is ready. Raises RemoteError (service failed, exit 1) with the last log
    lines, or ReadinessTimeout (exit 4) naming the last unmet step after `timeout_s` seconds
    (default: the service's `ready_timeout_s`)."""
    timeout_s = host.service.ready_timeout_s if timeout_s is None else timeout_s
    max_interval_s = max_poll_interval() if max_interval_s is None else max_interval_s
    start = clock()
    deadline = start + timeout_s
    first = manager.state()
    base_restarts, good, rounds, delay, unknown = first.restarts, 0, 0, 1.0, 0
    probe = Probe(False, "unit", "not checked yet")
    with api_client(host, transport) as client:
        while True:
            rounds += 1
            cancel.check("the next readiness poll")
            state = manager.state() if rounds > 1 else first
            if state.failed or state.restarts > base_restarts:
                why = "failed" if state.failed else f"restarted {state.restarts - base_restarts}x"
                state = manager.diagnose() if state.failed else state
                raise RemoteError(f"{host.name}: {host.unit} {why}: {state.describe()}\n"
                                  f"{logcause.explain(manager.log_tail(80)).rstrip()}")
            unknown = unknown + 1 if state.active == "unknown" else 0
            if not state.installed:
                raise RemoteError(f"{host.name}: {host.unit} is not installed (deploy it: ddtctl deploy {host.name})")
            if state.active == "inactive" or unknown >= 3:
                raise RemoteError(f"{host.name}: {host.unit} is {state.active} "
                                  f"(start it: ddtctl start {host.name})\n{manager.log_tail(20).rstrip()}".rstrip())
            probe = probe_http(client, host)
            if probe.step == "auth":
                raise auth_error(host, probe.detail)
            if on_round:
                on_round(probe)
            good = good + 1 if probe.ok else 0
            if good >= consecutive:
                return ReadyReport(host.name, True, round(clock() - start, 2), rounds, probe.models, probe.detail)
            wait = 1.0 if probe.ok else min(max_interval_s, delay) * random.uniform(0.8, 1.2)
            delay = 1.0 if probe.ok else min(max_interval_s, delay * 1.6)
            if clock() + wait > deadline:
                raise ReadinessTimeout(
                    f"{host.name}: not ready after {timeout_s:.0f} s ({rounds} rounds); last: "
                    f"{probe.step}: {probe.detail}\n{manager.log_tail(20).rstrip()}".rstrip())
            for _ in range(max(1, int(wait / 0.25))):  # short naps: a Ctrl-C is seen within 0.25 s
                if cancel.requested():
                    break
                sleep(wait / max(1, int(wait / 0.25)))
