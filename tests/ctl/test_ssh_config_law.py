"""The operator's ssh configuration is law: for each configuration of a matrix, the REAL OpenSSH
client (``ssh -F CONFIG -o BatchMode=yes``) and ddtctl's SshTransport run side by side against the
same real sshd (tests/fleet/sshd.py), each with its own copy of the same known_hosts files, and
must reach the same verdict (connect / refuse) and leave the same known_hosts contents behind.

Covered: StrictHostKeyChecking yes / ask / unset (ask) / accept-new / no / off with unknown,
known and changed keys; several UserKnownHostsFile files, ``~`` expansion, ``/dev/null``,
``none``; GlobalKnownHostsFile; HostKeyAlias; HashKnownHosts and hashed entries; wildcard and
negated host patterns; ``@revoked``; Host/Match precedence (first value wins); command-line ``-o``
(the inventory's ssh_options) over the file; ProxyJump with the jump host's own key. The one
deliberate difference (a changed key with StrictHostKeyChecking no) has its own test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
import pytest
import yaml

from ddtctl.cli._common import node_transport
from ddtctl.errors import HostKeyError
from ddtctl.inventory import parse_inventory
from tests.fleet.conftest import fleet_client_key, jump, make_node, pve1  # noqa: F401 - fixtures
from tests.fleet.sshd import SshServer, keygen

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def stale_key(tmp_path_factory) -> str:
    other = keygen(tmp_path_factory.mktemp("stale") / "k")
    return " ".join(Path(f"{other}.pub").read_text().split()[:2])


@dataclass
class Case:
    """A config (``{d}`` = the case's directory), initial files, command-line options, verdict.
    Files are written with ``{K}`` = the server's key line, ``{S}`` = another ed25519 key,
    ``{N}`` = the server's known_hosts name ``[127.0.0.1]:PORT``, ``{J}``/``{JK}`` the jump's."""

    id: str
    config: str
    files: dict[str, str] = field(default_factory=dict)
    expect: str = "connect"
    options: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("unknown+yes", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": ""}, "refuse"),
    Case("unknown+ask", "StrictHostKeyChecking ask\nUserKnownHostsFile {d}/kh", {"kh": ""}, "refuse"),
    Case("unknown+default", "UserKnownHostsFile {d}/kh", {"kh": ""}, "refuse"),
    Case("unknown+accept-new", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh", {"kh": ""}),
    Case("unknown+no", "StrictHostKeyChecking no\nUserKnownHostsFile {d}/kh", {"kh": ""}),
    Case("unknown+off", "StrictHostKeyChecking off\nUserKnownHostsFile {d}/kh", {}),
    Case("known+yes", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": "{N} {K}\n"}),
    Case("changed+accept-new", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh",
         {"kh": "{N} {S}\n"}, "refuse"),
    Case("changed+yes", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": "{N} {S}\n"}, "refuse"),
    Case("known-in-second-file", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh1 {d}/kh2",
         {"kh1": "", "kh2": "{N} {K}\n"}),
    Case("accept-new-writes-first-file", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh1 {d}/kh2",
         {"kh1": "", "kh2": ""}),
    Case("changed-in-second-file", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh1 {d}/kh2",
         {"kh1": "", "kh2": "{N} {S}\n"}, "refuse"),
    Case("tilde-expansion", "StrictHostKeyChecking yes\nUserKnownHostsFile ~/../..{d}/kh", {"kh": "{N} {K}\n"}),
    Case("dev-null+accept-new", "StrictHostKeyChecking accept-new\nUserKnownHostsFile /dev/null", {}),
    Case("dev-null+yes", "StrictHostKeyChecking yes\nUserKnownHostsFile /dev/null", {}, "refuse"),
    Case("none+accept-new", "StrictHostKeyChecking accept-new\nUserKnownHostsFile none\n"
         "GlobalKnownHostsFile {d}/global", {"global": ""}, "refuse"),
    Case("none+no", "StrictHostKeyChecking no\nUserKnownHostsFile none\nGlobalKnownHostsFile {d}/global",
         {"global": ""}, "refuse"),
    Case("none+known-in-global", "StrictHostKeyChecking accept-new\nUserKnownHostsFile none\n"
         "GlobalKnownHostsFile {d}/global", {"global": "{N} {K}\n"}),
    Case("first-file-not-writable+accept-new", "StrictHostKeyChecking accept-new\n"
         "UserKnownHostsFile {d}/missing/kh {d}/kh2", {"kh2": ""}),
    Case("none+yes", "StrictHostKeyChecking yes\nUserKnownHostsFile none\nGlobalKnownHostsFile {d}/global",
         {"global": ""}, "refuse"),
    Case("global-known", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh\nGlobalKnownHostsFile {d}/global",
         {"kh": "", "global": "{N} {K}\n"}),
    Case("global-changed", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh\n"
         "GlobalKnownHostsFile {d}/global", {"kh": "", "global": "{N} {S}\n"}, "refuse"),
    Case("alias-known", "StrictHostKeyChecking yes\nHostKeyAlias myalias\nUserKnownHostsFile {d}/kh",
         {"kh": "myalias {K}\n"}),
    Case("alias-not-under-address", "StrictHostKeyChecking yes\nHostKeyAlias myalias\nUserKnownHostsFile {d}/kh",
         {"kh": "{N} {K}\n"}, "refuse"),
    Case("alias-accept-new", "StrictHostKeyChecking accept-new\nHostKeyAlias myalias\nUserKnownHostsFile {d}/kh",
         {"kh": "{N} {S}\n"}),
    Case("hash-accept-new", "StrictHostKeyChecking accept-new\nHashKnownHosts yes\nUserKnownHostsFile {d}/kh",
         {"kh": ""}),
    Case("hashed-entry-known", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": "{HN} {K}\n"}),
    Case("wildcard-entry", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": "[127.0.0.?]:* {K}\n"}),
    Case("negated-entry", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh",
         {"kh": "[127.0.0.1]:*,!{N} {K}\n"}, "refuse"),
    Case("revoked", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh",
         {"kh": "@revoked {N} {K}\n{N} {K}\n"}, "refuse"),
    Case("host-star-first-wins", "#first\n", {"kh": ""}, "refuse"),
    Case("match-first-wins", "#match\n", {"kh": ""}),
    Case("command-line-over-file", "StrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh", {"kh": ""},
         "connect", {"StrictHostKeyChecking": "accept-new"}),
    Case("file-value-stays-without-option", "StrictHostKeyChecking accept-new\nUserKnownHostsFile {d}/kh",
         {"kh": ""}, "refuse", {"StrictHostKeyChecking": "yes"}),
    Case("jump-unknown+yes", "#jump\nStrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh",
         {"kh": "{N} {K}\n"}, "refuse"),
    Case("jump-known+yes", "#jump\nStrictHostKeyChecking yes\nUserKnownHostsFile {d}/kh",
         {"kh": "{N} {K}\n{J} {JK}\n"}),
]


def _config(case: Case, d: Path, srv: SshServer, key: Path, jump: SshServer) -> str:
    body = case.config.replace("{d}", str(d))
    block = srv.ssh_config_block(key).rstrip("\n") + "\n"
    indented = "".join(f"    {line}\n" for line in body.splitlines() if not line.startswith("#"))
    if case.config.startswith("#first"):
        return f"Host *\n    StrictHostKeyChecking yes\n    UserKnownHostsFile {d}/kh\n" + block + \
            "    StrictHostKeyChecking accept-new\n"
    if case.config.startswith("#match"):
        return f"Match originalhost pve1\n    StrictHostKeyChecking accept-new\n    UserKnownHostsFile {d}/kh\n" \
            + block + "    StrictHostKeyChecking yes\n"
    if case.config.startswith("#jump"):
        jump_block = jump.ssh_config_block(key).rstrip("\n") + "\n" + indented
        return block + "    ProxyJump jump\n" + indented + jump_block
    return block + indented


def _prepare(case: Case, d: Path, srv: SshServer, key: Path, jump: SshServer, stale: str) -> Path:
    d.mkdir(parents=True)
    values = {"{K}": srv.host_key_line, "{S}": stale, "{N}": f"[127.0.0.1]:{srv.port}",
              "{HN}": paramiko.HostKeys.hash_host(f"[127.0.0.1]:{srv.port}"),
              "{J}": f"[127.0.0.1]:{jump.port}", "{JK}": jump.host_key_line}
    for name, text in case.files.items():
        for k, v in values.items():
            text = text.replace(k, v)
        (d / name).write_text(text)
    cfg = d / "config"
    cfg.write_text(_config(case, d, srv, key, jump))
    return cfg


def _run_ssh(cfg: Path, options: dict[str, str]) -> str:
    opts = [f"-o{k}={v}" for k, v in options.items()]
    res = subprocess.run(["ssh", *opts, "-F", str(cfg), "-o", "BatchMode=yes", "pve1", "true"],
                         capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    return "connect" if res.returncode == 0 else f"refuse: {res.stderr.strip()}"


def _run_ddtctl(cfg: Path, options: dict[str, str]) -> str:
    """ddtctl as the CLI makes it: an inventory node `pve1` (its ssh_options = ``-o``) and
    $DDTCTL_SSH_CONFIG = the config."""
    inv = parse_inventory(yaml.safe_dump({
        "nodes": {"n": {"address": "pve1", "ssh_options": options}},
        "containers": {"ct": {"vmid": 200, "node": "n", "address": "127.0.0.1",
                              "service": {"kind": "ddtree", "port": 8000}}}}), cfg.parent / "inv.yaml")
    os.environ["DDTCTL_SSH_CONFIG"] = str(cfg)
    try:
        t = node_transport(inv.select(["ct"])[0])
        return "connect" if t.run(["true"]).ok else "failed"
    except HostKeyError as exc:
        return f"refuse: {exc}"
    finally:
        del os.environ["DDTCTL_SSH_CONFIG"]
        if "t" in locals():
            t.close()


def _contents(d: Path, name: str) -> dict[str, list[str]]:
    out = {}
    for path in sorted(d.iterdir()):
        if path.name == "config":
            continue
        lines = []
        for line in path.read_text().splitlines():
            host, _, key = line.partition(" ")
            if host.startswith("|1|"):
                ours = paramiko.HostKeys.hash_host(name, host) == host
                host = f"hashed({name})" if ours else "hashed(?)"
            lines.append(f"{host} {key}")
        out[path.name] = lines
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_ddtctl_reaches_the_verdict_of_openssh(case: Case, pve1, jump, fleet_client_key,  # noqa: F811
                                               stale_key, tmp_path):
    if shutil.which("ssh") is None:
        pytest.skip("the OpenSSH client is needed as the reference")
    srv = pve1.sshd
    verdicts, contents = {}, {}
    for who, run in (("ssh", _run_ssh), ("ddtctl", _run_ddtctl)):
        d = tmp_path / who
        cfg = _prepare(case, d, srv, fleet_client_key, jump, stale_key)
        verdicts[who] = run(cfg, case.options)
        contents[who] = _contents(d, f"[127.0.0.1]:{srv.port}")
    assert verdicts["ssh"].split(":")[0] == case.expect, verdicts["ssh"]      # the reference itself
    assert verdicts["ddtctl"].split(":")[0] == case.expect, verdicts["ddtctl"]
    assert contents["ddtctl"] == contents["ssh"]                               # same files written
    assert Path("/dev/null").is_char_device()


def test_changed_key_with_checking_off_is_refused_although_openssh_connects(pve1, fleet_client_key,  # noqa: F811
                                                                           stale_key, tmp_path):
    """The documented difference: OpenSSH connects to a host whose key CHANGED when
    StrictHostKeyChecking is no, but disables port forwarding, which ddtctl needs for every
    readiness probe; ddtctl refuses (never less safe than OpenSSH)."""
    case = Case("changed+no", "StrictHostKeyChecking no\nUserKnownHostsFile {d}/kh", {"kh": "{N} {S}\n"})
    cfg = _prepare(case, tmp_path / "d", pve1.sshd, fleet_client_key, pve1.sshd, stale_key)
    assert _run_ssh(cfg, {}) == "connect"
    verdict = _run_ddtctl(cfg, {})
    assert verdict.startswith("refuse") and "HOST KEY CHANGED" in verdict and "ssh-keygen" in verdict
    assert (tmp_path / "d" / "kh").read_text().count("\n") == 1
