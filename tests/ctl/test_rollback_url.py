"""After an automatic rollback the deploy reports where the service really is: the restored unit's
port and model name, not the failed inventory's (a local host, the engine emulation as its
release's server)."""

from __future__ import annotations

import json
import sys

from tests.ctl.test_interrupts import FAKE_ENGINE, Local, _port


def test_after_a_rollback_the_url_of_the_restored_unit_is_shown(tmp_path):
    local = Local(tmp_path, "kind: ddtree, ready_timeout_s: 20")
    local.release(local.deployed, f'shift\nexec {sys.executable} {FAKE_ENGINE} serve embedded "$@"\n')
    try:
        first = local.run("deploy", "here", "--no-smoke", "--json")
        assert first.returncode == 0, first.stderr
        old_url = json.loads(first.stdout)["hosts"][0]["url"]
        new_port = _port()
        (tmp_path / "inventory.yaml").write_text(       # another port, and a server that cannot start
            f"local:\n  here:\n    service: {{port: {new_port}, kind: ddtree, ready_timeout_s: 20, "
            "model_id: other, extra_args: [--delay, not-a-number]}\n")
        res = local.run("deploy", "here", "--no-smoke", "--json")
        host = json.loads(res.stdout)["hosts"][0]
        assert res.returncode == 1 and host["rolled_back"], res.stderr
        assert (host["url"], host["model_id"]) == (old_url, "SmolLM2-135M-Instruct"), host
        assert f"here: rolled back: serving SmolLM2-135M-Instruct at {old_url}" in res.stderr
        assert f":{new_port}/" not in res.stderr.split("rollback")[-1]
    finally:
        local.stop_service()
