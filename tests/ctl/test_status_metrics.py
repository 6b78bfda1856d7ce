"""parse_metrics on Prometheus exposition text (no server)."""

from __future__ import annotations

import pytest

from ddtctl.ops.status import parse_metrics

# per-request histograms skewed by 1-token readiness probes (mean 8000 tok/s, tau 1.0)
HISTOGRAMS = """\
# HELP ddtree_acceptance_length Mean accepted tokens per target forward (tau), per request.
# TYPE ddtree_acceptance_length histogram
ddtree_acceptance_length_bucket{le="+Inf"} 10.0
ddtree_acceptance_length_count 10.0
ddtree_acceptance_length_sum 10.0
# HELP ddtree_decode_tokens_per_second Decode speed per request (tokens/s).
# TYPE ddtree_decode_tokens_per_second histogram
ddtree_decode_tokens_per_second_bucket{le="+Inf"} 10.0
ddtree_decode_tokens_per_second_count 10.0
ddtree_decode_tokens_per_second_sum 80000.0
"""

COUNTERS = """\
# HELP ddtree_decode_tokens_total Tokens produced by decode rounds (after prefill).
# TYPE ddtree_decode_tokens_total counter
ddtree_decode_tokens_total 1200.0
# HELP ddtree_decode_tokens_created Tokens produced by decode rounds (after prefill).
# TYPE ddtree_decode_tokens_created gauge
ddtree_decode_tokens_created 1.7e+09
# HELP ddtree_decode_seconds_total Time spent in decode rounds (s).
# TYPE ddtree_decode_seconds_total counter
ddtree_decode_seconds_total 10.0
# HELP ddtree_decode_rounds_total Target forwards after prefill.
# TYPE ddtree_decode_rounds_total counter
ddtree_decode_rounds_total 400.0
"""


def test_counters_win_over_probe_skewed_histograms() -> None:
    accept, tps = parse_metrics(HISTOGRAMS + COUNTERS)
    assert tps == pytest.approx(120.0) and accept == pytest.approx(3.0)


def test_histograms_are_the_fallback_without_counters() -> None:
    assert parse_metrics(HISTOGRAMS) == (pytest.approx(1.0), pytest.approx(8000.0))


def test_zero_counters_fall_back() -> None:
    zero = COUNTERS.replace(" 1200.0", " 0.0").replace(" 10.0\n", " 0.0\n").replace(" 400.0", " 0.0")
    assert parse_metrics(HISTOGRAMS + zero) == (pytest.approx(1.0), pytest.approx(8000.0))
    assert parse_metrics("") == (None, None)


def test_counters_as_prometheus_client_exports_them() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    reg = CollectorRegistry()
    Counter("ddtree_decode_tokens", "t", registry=reg).inc(500)
    Counter("ddtree_decode_seconds", "s", registry=reg).inc(4)
    Counter("ddtree_decode_rounds", "r", registry=reg).inc(200)
    accept, tps = parse_metrics(generate_latest(reg).decode())
    assert tps == pytest.approx(125.0) and accept == pytest.approx(2.5)


def _status_against(monkeypatch, tmp_path, answers: dict):
    """host_status of a local host whose HTTP server answers `answers[path]` = (code, body) (the
    service manager says active); the real server's /health is 200 while loading (liveness) and
    503 only when its engine is gone or stalled."""
    import http.server
    import json
    import threading
    from pathlib import Path

    from ddtctl.inventory import parse_inventory
    from ddtctl.ops import status as status_ops
    from ddtctl.ops.unitstate import UnitState
    from ddtctl.remote.transport import LocalTransport

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code, body = answers.get(self.path, (404, {"error": {"message": "not found"}}))
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    class Manager:
        def state(self):
            return UnitState("active", "running", "success")

        diagnose = state

    monkeypatch.setattr(status_ops, "manager_for", lambda host, transport: Manager())
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path))
    inv = parse_inventory(f"local:\n  here: {{service: {{kind: ddtree, port: {server.server_address[1]}}}}}\n",
                          Path("inv.yaml"))
    try:
        return status_ops.host_status(inv.hosts["here"], LocalTransport("here"), gpus=False)
    finally:
        server.shutdown()


def test_status_shows_loading_not_failed(monkeypatch: pytest.MonkeyPatch, tmp_path, capsys) -> None:
    from ddtctl import report

    st = _status_against(monkeypatch, tmp_path, {
        "/health": (200, {"status": "ok", "state": "loading", "reason": None}),
        "/ready": (503, {"state": "loading", "detail": "loading the model"}),
        "/v1/models": (503, {"error": {"message": "not ready"}})})
    assert (st.ready, st.ready_state, st.errors, st.live) == (False, "loading", [], True)
    assert st.ready_detail == "/ready 503 state=loading"
    report.status_table([st])
    row = next(line for line in capsys.readouterr().err.splitlines() if "here" in line)
    assert "loading" in row and "failed" not in row


def test_a_stalled_engine_is_not_ok_although_ready_says_ready(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                              capsys) -> None:
    """Liveness and readiness are both read: /ready 200 with /health 503 (a stuck engine round)
    is `stalled` with the server's reason, in the table and the JSON."""
    from ddtctl import report

    why = "stalled: the engine round in progress has run 301.0 s (--stall-seconds 300)"
    st = _status_against(monkeypatch, tmp_path, {
        "/health": (503, {"status": "unhealthy", "state": "ready", "reason": why}),
        "/ready": (200, {"state": "ready"}),
        "/v1/models": (200, {"object": "list", "data": [{"id": "SmolLM2-135M-Instruct"}]})})
    doc = st.to_dict()
    assert st.ready and st.live is False and not st.ok
    assert (doc["ok"], doc["verdict"], doc["cause"]) == (False, "stalled", f"/health 503: {why}")
    report.status_table([st])
    err = capsys.readouterr().err
    assert "stalled" in err and "--stall-seconds 300" in err
