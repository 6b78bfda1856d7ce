"""The cause of a failed start is found in the service log and shown first (ops/logcause.py), and
what the weights step decides from what it recorded after the last push (ops/weights.py)."""

from __future__ import annotations

from ddtctl.ops import logcause
from ddtctl.ops.weights import parse_observed, plan_sends

OLD_RUNS = "".join(f"Starting ddtree server...\nINFO: loading model\nINFO: ready {i}\n" for i in range(15))
FAILED = ("Starting ddtree server...\nINFO: loading model\nTraceback (most recent call last):\n"
          '  File "/opt/ddtree/current/venv/lib/python3.11/site-packages/ddtree_server/models/load.py", line 9\n'
          "    raise GGUFError(msg)\nddtree_server.models.load.GGUFError: /srv/models/x.gguf: not a GGUF file\n"
          "ddtree-ct200.service: Main process exited, code=exited, status=1/FAILURE\n"
          "ddtree-ct200.service: Failed with result 'exit-code'.\n")


def test_the_cause_comes_first_and_only_the_failed_starts_lines_follow() -> None:
    text = logcause.explain(OLD_RUNS + FAILED)
    lines = text.splitlines()
    assert lines[0] == "cause: ddtree_server.models.load.GGUFError: /srv/models/x.gguf: not a GGUF file"
    assert "ready 14" not in text and lines[2] == "Starting ddtree server..."   # older runs left out


def test_an_automatic_restart_that_printed_nothing_yet_does_not_hide_the_cause() -> None:
    text = OLD_RUNS + FAILED + "ddtree-ct200.service: Scheduled restart job, restart counter is at 1.\n" \
        "Starting ddtree server...\n"
    assert logcause.explain(text).startswith("cause: ddtree_server.models.load.GGUFError")


def test_without_an_exception_the_last_own_line_is_the_cause() -> None:
    lines = logcause.last_start("Starting x...\nusage: engine [-h]\nengine: error: bad --delay\n"
                                "x.service: Main process exited, code=exited, status=2/INVALIDARGUMENT\n")
    assert logcause.cause(lines) == "engine: error: bad --delay"
    assert logcause.cause(["Starting x...", "x.service: Failed with result 'exit-code'."]) == ""


def test_weights_send_what_differs_and_rehash_what_changed_on_the_target() -> None:
    local = {"a.bin": {"size": 10, "sha256": "aa"}, "b.bin": {"size": 20, "sha256": "bb"},
             "c.bin": {"size": 30, "sha256": "cc"}}
    observed = parse_observed("10 1700000000.1 11 a.bin\n20 1700000009.5 12 b.bin\n30 1700000000.3 13 c.bin\n")
    recorded = {"a.bin": [10, "1700000000.1", 11], "b.bin": [20, "1700000000.2", 12], "c.bin": [30, "1700000000.3", 13]}
    remote = {**local, "c.bin": {"size": 30, "sha256": "old"}}
    assert plan_sends(local, remote, recorded, observed) == (["c.bin"], ["b.bin"])   # b: same size, new mtime
    assert plan_sends(local, remote, recorded, observed, verify=True) == (["c.bin"], ["a.bin", "b.bin"])
    assert plan_sends(local, local, {}, observed) == ([], ["a.bin", "b.bin", "c.bin"])  # nothing recorded yet
    assert parse_observed("5 1.0 7 \n", single_name="m.gguf") == {"m.gguf": [5, "1.0", 7]}
