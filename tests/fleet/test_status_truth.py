"""`ddtctl status` and `logs` tell the truth, on the test fleet over real SSH.

No model server runs here: where a host's address must answer HTTP, Python's
http.server serves a `ready` file and a `/v1/models` listing, standing for whatever else answers
at that address (another container's server): exactly the case where a status that only probes
HTTP would call a host ok that ddtctl cannot manage (one such server per host: an inventory
allows one service per address and port). Faults, by class:
* the container is stopped (pct: "container '341' not running!", exit 255);
* the container is not where the inventory says: a wrong vmid, a container that lives on another
  node, a node without pct;
* the node is unreachable: a TCP listener that never sends an SSH banner, a closed port;
* nvidia-smi reports [N/A] / [Insufficient Permissions] (MIG GPU in an unprivileged container).
"""

from __future__ import annotations

import functools
import http.server
import json
import socket
import threading

import pytest

from tests.fleet.fleet import CtSpec, Fleet
from tests.fleet.node import fleet_available, shared_node
from tests.fleet.sshd import free_port

pytestmark = [pytest.mark.fleet]
MIG_UNPRIVILEGED = {"gpus": [{"mig.mode.current": "Enabled", "memory.total": "[Insufficient Permissions]",
                              "memory.used": "[Insufficient Permissions]", "utilization.gpu": "[N/A]"}]}


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def sfleet(tmp_path_factory):
    reason = fleet_available()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("status")
    fleet = Fleet(base, specs=(CtSpec("ct340", 340, "fleet-s", None, "h200"),
                               CtSpec("ct341", 341, "fleet-s", None, "h200"),
                               CtSpec("ct345", 345, "fleet-t", None, "h200")))
    silent = socket.socket()                     # accepts TCP, never says a word: no SSH banner
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(16)], daemon=True).start()
    web = base / "web"
    (web / "v1").mkdir(parents=True)
    (web / "ready").write_text('{"state": "ready"}')
    (web / "v1" / "models").write_text(json.dumps({"object": "list", "data": [{"id": "SmolLM2-135M-Instruct"}]}))
    servers = []                                 # one per host: ports are unique per address in an inventory

    def web_port() -> int:
        handler = functools.partial(Quiet, directory=str(web))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    try:
        fleet.start()
        fleet.nodes["fleet-s"].pct("stop", "341")
        fleet.set_gpu("ct340", MIG_UNPRIVILEGED)
        nopct = shared_node("fleet-nopct")
        (nopct.bin_dir / "pct").unlink(missing_ok=True)
        with open(fleet.known_hosts, "a") as fh:
            fh.write(nopct.sshd.known_hosts_line + "\n")
        doc = fleet.inventory_doc()
        opts = doc["nodes"]["fleet-s"]["ssh_options"]
        doc["nodes"]["fleet-nopct"] = {"address": "127.0.0.1", "port": nopct.sshd.port, "user": "root",
                                       "ssh_options": opts}
        doc["nodes"]["silent"] = {"address": "127.0.0.1", "port": silent.getsockname()[1], "user": "root",
                                  "ssh_options": opts}
        doc["nodes"]["closed"] = {"address": "127.0.0.1", "port": free_port(), "user": "root", "ssh_options": opts}
        ct = doc["containers"]
        for name in ("ct340", "ct341", "ct345"):
            ct[name]["service"]["port"] = web_port()
        template = ct["ct340"]
        for name, vmid, node in (("wrongvmid", 399, "fleet-s"), ("othernode", 340, "fleet-t"),
                                 ("nopct", 340, "fleet-nopct"), ("nobanner", 340, "silent"),
                                 ("refused", 340, "closed")):
            ct[name] = {**template, "vmid": vmid, "node": node,
                        "service": {**template["service"], "unit": f"ddtree-{name}.service", "port": web_port()}}
        fleet.inventory.write_text(json.dumps(doc))
        yield fleet
    finally:
        for server in servers:
            server.shutdown()
        for conn in held:
            conn.close()
        silent.close()
        fleet.close()


@pytest.fixture(scope="module")
def status_all(sfleet):
    res = sfleet.ddtctl("status", "--all", "--json", "--parallel", "8", timeout=300)
    print(res.stderr)
    return res, {h["host"]: h for h in json.loads(res.stdout)["hosts"]}


def row(stderr: str, host: str) -> str:
    """The table row of `host`, its wrapped continuation lines joined (cells may wrap)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"│ {host} "))
    end = start + 1
    while end < len(lines) and lines[end].startswith("│  "):
        end += 1
    cells = zip(*(line.split("│") for line in lines[start:end]))
    return " │ ".join(" ".join(part.strip() for part in cell if part.strip()) for cell in cells)


def test_no_library_traceback_and_exit_3(status_all):
    res, _ = status_all
    assert res.returncode == 3 and "Traceback" not in res.stderr and "paramiko" not in res.stderr


def test_a_stopped_container_is_container_stopped_not_a_gpu_error(status_all):
    res, hosts = status_all
    h = hosts["ct341"]
    assert not h["ok"] and h["verdict"] == "container stopped" and h["container"]["state"] == "stopped", h
    assert h["gpu_error"] is None and h["gpus"] is None and h["unit"] is None
    assert "container stopped" in row(res.stderr, "ct341")


@pytest.mark.parametrize(("host", "verdict", "words"), [
    ("wrongvmid", "container missing", "container 399 does not exist on node fleet-s"),
    ("othernode", "container missing", "container 340 does not exist on node fleet-t"),
    ("nopct", "no pct", "pct not found on the node"),
])
def test_a_container_not_where_the_inventory_says_is_never_ok(status_all, host, verdict, words):
    """Its address answers HTTP like a ready server (another container's), yet it is not ok."""
    res, hosts = status_all
    h = hosts[host]
    assert not h["ok"] and h["verdict"] == verdict and words in h["cause"], h
    assert h["gpu_error"] is None                            # pct's failure is not filed as a GPU error
    assert verdict in row(res.stderr, host) and words in res.stderr


def test_an_unreachable_node_says_unreachable_in_the_table_with_the_cause(status_all):
    res, hosts = status_all
    for host, causes in (("nobanner", ("no SSH banner in", "SSH handshake not completed in", "no answer in")),
                         ("refused", ("connection refused",))):
        h = hosts[host]
        assert h["unreachable"] and h["verdict"] == "unreachable" and not h["ok"], h
        assert any(c in h["cause"] for c in causes), h["cause"]
        line = row(res.stderr, host)
        assert "unreachable" in line and any(c in line for c in causes), line


def test_nvidia_smi_unavailable_values_are_shown_with_their_meaning(status_all):
    res, hosts = status_all
    (gpu,) = hosts["ct340"]["gpus"]
    assert (gpu["memory_used_mib"], gpu["memory_total_mib"], gpu["utilization_pct"]) == \
        ("[Insufficient Permissions]", "[Insufficient Permissions]", "[N/A]")
    assert gpu["mig_mode"] == "Enabled"
    assert "MIG mode" in gpu["notes"]["[N/A]"] and "unprivileged container" in gpu["notes"]["[Insufficient Permissions]"]
    line = row(res.stderr, "ct340")
    assert "[N/A]" in line and "[Insufficient Permissions]" in line
    assert "MIG mode" in line and "unprivileged container" in line


def test_logs_of_a_stopped_container_fail_with_pcts_message(sfleet):
    res = sfleet.ddtctl("logs", "ct341")
    assert res.returncode == 1 and res.stdout == ""
    assert "container '341' not running!" in res.stderr and "Traceback" not in res.stderr
    ok = sfleet.ddtctl("logs", "ct340")                      # a running container: journalctl's answer
    assert ok.returncode == 0 and ok.stdout == "-- No entries --\n", ok.stderr
