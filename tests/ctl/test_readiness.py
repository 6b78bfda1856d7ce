"""wait-ready on real processes (a crashing service, an HTTP server that is not a model server) and
the probe parsers (`systemctl show`, Prometheus /metrics of the three engines)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from ddtctl.errors import ReadinessTimeout, RemoteError
from ddtctl.inventory_schema import DdtreeService, Host, SglangService
from ddtctl.ops.readiness import max_poll_interval, wait_ready
from ddtctl.ops.status import parse_metrics
from ddtctl.ops.supervisor import LocalSupervisor, parse_show
from ddtctl.ops.units import ServiceSpec, render_local
from ddtctl.remote.transport import LocalTransport


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _service(tmp_path: Path, argv: list[str], kind: str = "ddtree") -> tuple[Host, LocalSupervisor]:
    port = _free_port()
    svc = (DdtreeService(kind="ddtree", port=port) if kind == "ddtree"
           else SglangService(kind="sglang", port=port, target={"path": "/m/q"}))
    host = Host("here", "local", "127.0.0.1", str(tmp_path), svc)
    sup = LocalSupervisor(tmp_path / "sv", stop_timeout_s=5)
    sup.activate()
    argv = [a.replace("PORT", str(port)) for a in argv]
    sup.spec_file.write_text(render_local(ServiceSpec("t.service", kind, "t", argv, {}, str(tmp_path / "e"),
                                                      working_dir=str(tmp_path))))
    return host, sup


def test_crashing_service_fails_fast_with_its_log(tmp_path: Path) -> None:
    host, sup = _service(tmp_path, [sys.executable, "-c",
                                    "import time, sys; print('CUDA out of memory', flush=True); "
                                    "time.sleep(0.5); sys.exit(1)"])
    sup.start()
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        wait_ready(host, LocalTransport(), sup, timeout_s=120)
    assert time.monotonic() - started < 30                    # not the 120 s deadline
    assert "here: ddtree.service failed" in str(info.value)
    assert "CUDA out of memory" in str(info.value)            # the last log lines come along
    assert info.value.exit_code == 1


def test_wrong_server_times_out_naming_the_step(tmp_path: Path) -> None:
    host, sup = _service(tmp_path, [sys.executable, "-m", "http.server", "PORT", "--bind", "127.0.0.1"])
    sup.start()
    try:
        rounds = []
        with pytest.raises(ReadinessTimeout) as info:
            wait_ready(host, LocalTransport(), sup, timeout_s=6, on_round=rounds.append)
        message = str(info.value)
        assert message.startswith("here: not ready after 6 s")
        assert "last: health: /ready 404" in message or "connection refused" in message
        assert info.value.exit_code == 4
        assert rounds and not any(p.ok for p in rounds)
    finally:
        sup.stop()


def test_external_engines_are_probed_on_health(tmp_path: Path) -> None:
    host, sup = _service(tmp_path, [sys.executable, "-m", "http.server", "PORT", "--bind", "127.0.0.1"], "sglang")
    (tmp_path / "health").write_text("ok")                      # http.server serves the cwd: /health is 200
    sup.start()
    try:
        with pytest.raises(ReadinessTimeout) as info:
            wait_ready(host, LocalTransport(), sup, timeout_s=6)
        assert "last: models: /v1/models 404" in str(info.value) or "connection refused" in str(info.value)
    finally:
        sup.stop()


def test_inactive_service_is_reported_at_once(tmp_path: Path) -> None:
    host, sup = _service(tmp_path, [sys.executable, "-c", "pass"])
    with pytest.raises(RemoteError, match="is inactive \\(start it: ddtctl start here\\)"):
        wait_ready(host, LocalTransport(), sup, timeout_s=60)


@pytest.mark.parametrize(("text", "expected"), [
    ("Result=success\nNRestarts=0\nMainPID=4242\nActiveState=active\nSubState=running\n",
     ("active", "running", "success", 0, 4242, False)),
    ("MainPID=0\nNRestarts=5\nResult=start-limit-hit\nActiveState=failed\nSubState=failed\n",
     ("failed", "failed", "start-limit-hit", 5, None, True)),
    ("ActiveState=activating\nSubState=auto-restart\nResult=exit-code\nNRestarts=2\nMainPID=0\n",
     ("activating", "auto-restart", "exit-code", 2, None, False)),
    ("", ("unknown", "", "", 0, None, False)),
])
def test_parse_systemctl_show(text: str, expected: tuple) -> None:
    st = parse_show(text)
    assert (st.active, st.sub, st.result, st.restarts, st.pid, st.failed) == expected


DDTREE_METRICS = """\
# HELP ddtree_acceptance_length Mean accepted tokens per target forward (tau), per request.
# TYPE ddtree_acceptance_length histogram
ddtree_acceptance_length_bucket{le="1.0"} 0.0
ddtree_acceptance_length_bucket{le="+Inf"} 4.0
ddtree_acceptance_length_count 4.0
ddtree_acceptance_length_sum 14.0
# HELP ddtree_decode_tokens_per_second Decode speed per request (tokens/s).
# TYPE ddtree_decode_tokens_per_second histogram
ddtree_decode_tokens_per_second_bucket{le="+Inf"} 4.0
ddtree_decode_tokens_per_second_count 4.0
ddtree_decode_tokens_per_second_sum 400.0
# HELP ddtree_queue_depth Requests waiting for the worker.
# TYPE ddtree_queue_depth gauge
ddtree_queue_depth 0.0
"""
SGLANG_METRICS = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="Qwen3.6-27B",engine_type="unified"} 5.25
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="Qwen3.6-27B",engine_type="unified"} 88.5
"""
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="q"} 100.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="q"} 350.0
"""


@pytest.mark.parametrize(("text", "expected"), [
    (DDTREE_METRICS, (3.5, 100.0)), (SGLANG_METRICS, (5.25, 88.5)), (VLLM_METRICS, (4.5, None)), ("", (None, None)),
])
def test_parse_metrics(text: str, expected: tuple) -> None:
    assert parse_metrics(text) == expected


def test_ctrl_c_ends_a_readiness_wait_within_a_poll(tmp_path: Path) -> None:
    """A service that never becomes ready; a Ctrl-C (cancel.request from another thread) ends the
    wait within about a second, as Interrupted (exit 130), long before the deadline."""
    import threading

    from ddtctl import cancel

    host, sup = _service(tmp_path, [sys.executable, "-c", "import time; time.sleep(600)"])
    sup.start()
    try:
        threading.Timer(1.5, cancel.request).start()
        started = time.monotonic()
        with pytest.raises(cancel.Interrupted) as info:
            wait_ready(host, LocalTransport(), sup, timeout_s=300)
        assert time.monotonic() - started < 15 and info.value.exit_code == 130
    finally:
        cancel.reset()
        sup.stop()


def test_the_longest_poll_wait_can_only_be_lowered() -> None:
    assert max_poll_interval({}) == 10.0
    assert max_poll_interval({"DDTCTL_READY_POLL_MAX_S": "2"}) == 2.0
    for bad in ("0.5", "30", "nan", "x", ""):
        assert max_poll_interval({"DDTCTL_READY_POLL_MAX_S": bad}) == 10.0, bad
