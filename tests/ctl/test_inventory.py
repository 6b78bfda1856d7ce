"""Inventory loading: every error as exact `FILE:LINE: key.path: message`; host selection."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ddtctl.errors import InventoryError, UsageError
from ddtctl.inventory import inventory_path, load_inventory, parse_inventory

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
nodes:
  pve1:
    address: 10.0.0.1
  pve2:
    address: 10.0.0.2
    user: admin
    port: 2222
containers:
  ct200:
    vmid: 200
    node: pve1
    address: 10.0.0.20
    groups: [gpu]
    service:
      kind: ddtree
      port: 8000
      gpus: [0]
  ct201:
    vmid: 201
    node: pve1
    address: 10.0.0.21
    service:
      kind: vllm
      port: 8001
      target: {path: /models/q}
  ct129:
    vmid: 129
    node: pve2
    address: 10.0.0.29
    groups: [gpu]
    service:
      kind: sglang
      port: 30000
      target: {path: /models/q, source: /src/q}
local:
  here:
    service: {kind: ddtree, port: 8411, device: cpu}
groups:
  web: [ct201, here]
"""


def _errors(text: str, name: str = "inventory.yaml") -> list[str]:
    with pytest.raises(InventoryError) as info:
        parse_inventory(textwrap.dedent(text), Path(name))
    assert info.value.exit_code == 2
    return str(info.value).splitlines()


def _edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


def test_good_inventory_resolves() -> None:
    inv = parse_inventory(GOOD, Path("inventory.yaml"))
    assert list(inv.hosts) == ["ct200", "ct201", "ct129", "here"]
    ct = inv.hosts["ct200"]
    assert (ct.kind, ct.vmid, ct.node_name, ct.node.address, ct.root, ct.unit) == (
        "container", 200, "pve1", "10.0.0.1", "/opt/ddtree", "ddtree.service")
    assert ct.model_id == "SmolLM2-135M-Instruct" and ct.bind == "0.0.0.0"
    assert inv.hosts["ct201"].model_id == "q" and inv.hosts["ct201"].unit == "vllm.service"
    assert inv.hosts["here"].bind == "127.0.0.1" and inv.hosts["here"].kind == "local"
    assert inv.groups["gpu"] == ["ct200", "ct129"] and inv.groups["pve1"] == ["ct200", "ct201"]


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("    vmid: 200\n", "    vmid: 42\n",
     "inventory.yaml:10: containers.ct200.vmid: Input should be greater than or equal to 100"),
    ("    vmid: 200\n", "    vmid: two\n",
     "inventory.yaml:10: containers.ct200.vmid: Input should be a valid integer, not the string 'two'"),
    ("    node: pve1\n    address: 10.0.0.20\n", "    node: pve9\n    address: 10.0.0.20\n",
     "inventory.yaml:11: containers.ct200.node: undefined node 'pve9'; did you mean 'pve2'?"),
    ("    node: pve1\n    address: 10.0.0.20\n", "    node: zzz\n    address: 10.0.0.20\n",
     "inventory.yaml:11: containers.ct200.node: undefined node 'zzz' (nodes: pve1, pve2)"),
    ("    port: 2222\n", "    port: 2222\n    colour: blue\n", "inventory.yaml:8: nodes.pve2.colour: unknown key"),
    ("      port: 8000\n      gpus", "      prot: 8000\n      gpus",
     "inventory.yaml:14: containers.ct200.service.port: required key is missing\n"
     "inventory.yaml:16: containers.ct200.service.prot: unknown key"),
    ("      kind: vllm\n", "      kind: tgi\n",
     "inventory.yaml:23: containers.ct201.service: kind must be one of ddtree, sglang, vllm"),
    ("      port: 30000\n", "      port: many\n",
     "inventory.yaml:33: containers.ct129.service.port: Input should be a valid integer, not the string 'many'"),
    ("    service: {kind: ddtree, port: 8411, device: cpu}\n", "    service: {kind: ddtree, device: cpu}\n",
     "inventory.yaml:37: local.here.service.port: required key is missing"),
    ("  web: [ct201, here]\n", "  web: [ct201, ct999]\n", "inventory.yaml:39: groups.web[1]: unknown host 'ct999'; did you mean 'ct129'?"),
    ("  ct201:\n    vmid: 201\n", "  ct201:\n    vmid: 200\n",
     "inventory.yaml:19: containers.ct201.vmid: vmid 200 already used by ct200 on node pve1"),
    ("      target: {path: /models/q}\n", "",
     "inventory.yaml:23: containers.ct201.service.kind: a vllm service needs `target:` (the model path)"),
    ("      gpus: [0]\n", "      gpus: [0]\n      environment: {BAD-NAME: x}\n",
     "inventory.yaml:18: containers.ct200.service.environment: 'BAD-NAME' is not a valid "
     "environment variable name (letters, digits, _)"),
    ("      target: {path: /models/q}\n", "      target: {path: models/q}\n",
     "inventory.yaml:25: containers.ct201.service.target.path: must be an absolute path (starting with /)"),
])
def test_error_lines(old: str, new: str, expected: str) -> None:
    assert _errors(_edit(old, new)) == expected.split("\n")


def test_duplicate_keys_and_names() -> None:
    dup = GOOD.replace("local:\n  here:", "local:\n  ct200:").replace("[ct201, here]", "[ct201]")
    assert _errors(dup) == ["inventory.yaml:36: local.ct200: name already used under containers:"]
    twice = GOOD + "  web: [ct200]\n"
    assert _errors(twice) == ["inventory.yaml:40: groups.web: duplicate key (first defined on line 39)"]


def test_all_errors_reported_in_line_order() -> None:
    text = _edit("    vmid: 200\n", "    vmid: 1\n").replace("      port: 30000\n", "      port: 70000\n")
    assert _errors(text, "fleet.yaml") == [
        "fleet.yaml:10: containers.ct200.vmid: Input should be greater than or equal to 100",
        "fleet.yaml:33: containers.ct129.service.port: Input should be less than or equal to 65535",
    ]


def test_yaml_syntax_and_shape_errors(tmp_path: Path) -> None:
    assert _errors("nodes:\n  pve1: [unclosed\n") == [
        "inventory.yaml:3: invalid YAML: expected ',' or ']', but got '<stream end>'"]
    assert _errors("- a\n- b\n") == ["inventory.yaml:1: the top level must be a mapping"]
    with pytest.raises(InventoryError, match="cannot read inventory"):
        load_inventory(tmp_path / "missing.yaml")


def test_inventory_path_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Found from any directory: upward from the working directory, then
    $XDG_CONFIG_HOME/ddtctl/inventory.yaml, then the checkout's own (its `local` host)."""
    monkeypatch.delenv("DDTCTL_INVENTORY", raising=False)
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    checkout = Path(__file__).resolve().parents[2] / "inventory.yaml"
    assert inventory_path() == checkout                          # nothing nearer: the checkout's
    (tmp_path / "config" / "ddtctl").mkdir(parents=True)
    (tmp_path / "config" / "ddtctl" / "inventory.yaml").write_text(GOOD)
    assert inventory_path() == tmp_path / "config" / "ddtctl" / "inventory.yaml"
    (tmp_path / "a" / "inventory.yaml").write_text(GOOD)
    assert inventory_path() == (tmp_path / "a" / "inventory.yaml").resolve()
    assert load_inventory().hosts["here"].name == "here"
    monkeypatch.setenv("DDTCTL_INVENTORY", "/x/fleet.yaml")
    assert inventory_path() == Path("/x/fleet.yaml")
    assert inventory_path("other.yaml") == Path("other.yaml")


def test_local_root_follows_ddtctl_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path))
    inv = parse_inventory(GOOD, Path("inventory.yaml"))
    assert inv.hosts["here"].root == str(tmp_path / "hosts" / "here")


@pytest.mark.parametrize(("words", "kwargs", "expected"), [
    (["ct200"], {}, ["ct200"]),
    (["gpu"], {}, ["ct200", "ct129"]),
    (["pve1"], {}, ["ct200", "ct201"]),
    (["ct2*"], {}, ["ct200", "ct201"]),
    (["web", "ct201", "ct200"], {}, ["ct201", "here", "ct200"]),
    ([], {"all_hosts": True}, ["ct200", "ct201", "ct129", "here"]),
    ([], {"all_hosts": True, "limit": "ct1*,here"}, ["ct129", "here"]),
    ([], {"all_hosts": True, "limit": "gpu"}, ["ct200", "ct129"]),
])
def test_select(words: list[str], kwargs: dict, expected: list[str]) -> None:
    inv = parse_inventory(GOOD, Path("inventory.yaml"))
    assert [h.name for h in inv.select(words, **kwargs)] == expected


def test_select_refuses_nothing_and_unknown() -> None:
    inv = parse_inventory(GOOD, Path("inventory.yaml"))
    with pytest.raises(UsageError, match="name a HOST or group, or pass --all"):
        inv.select([])
    with pytest.raises(UsageError, match="unknown host or group 'ct129x'; did you mean 'ct129'"):
        inv.select(["ct129x"])
    with pytest.raises(UsageError, match="no hosts selected"):
        inv.select(["gpu"], limit="nomatch*")


def test_shipped_inventories_validate() -> None:
    default = load_inventory(REPO / "inventory.yaml")
    assert list(default.hosts) == ["local"]
    local = default.hosts["local"]
    assert (local.kind, local.address, local.service.kind, local.service.device, local.service.dtype) == (
        "local", "127.0.0.1", "ddtree", "cpu", "fp32")
    # schema validation only: these are real machines, nothing here connects to them
    fleet = load_inventory(REPO / "examples" / "proxmox-fleet.yaml")
    assert {n: (h.node_name, h.vmid, h.service.kind) for n, h in fleet.hosts.items()} == {
        "ct200": ("pve1", 200, "ddtree"), "ct129": ("pro6000", 129, "sglang")}
    assert fleet.hosts["ct129"].service.port == 30000
    assert fleet.hosts["ct200"].service.gpus == ["0"] and fleet.hosts["ct200"].service.weights == "shared"
    assert (fleet.hosts["ct200"].packages.mode, fleet.hosts["ct200"].packages.extra_index_urls) == (
        "index", ("https://download.pytorch.org/whl/cu124",))
    assert local.packages.mode == "system"


def test_not_utf8_is_an_inventory_error(tmp_path: Path) -> None:
    bad = tmp_path / "inv.yaml"
    bad.write_bytes(b"local:\n  a:\n    service: {kind: ddtree, port: 8000}  # caf\xe9\n")
    with pytest.raises(InventoryError) as info:
        load_inventory(bad)
    assert str(info.value).startswith(f"{bad}: cannot read inventory: not UTF-8 (line 3")
    assert info.value.exit_code == 2


@pytest.mark.parametrize(("service", "key", "message"), [
    ("port: true", "port", "Input should be a valid integer, not the boolean true"),
    ("port: 8000, ready_timeout_s: true", "ready_timeout_s", "valid number, not the boolean true"),
    ("port: 8000, tree_budget: false", "tree_budget", "valid integer, not the boolean false"),
])
def test_booleans_are_not_numbers(service: str, key: str, message: str) -> None:
    (err,) = _errors(f"local:\n  a:\n    service: {{kind: ddtree, {service}}}\n")
    assert err.startswith(f"inventory.yaml:3: local.a.service.{key}: ") and message in err


def test_duplicate_endpoints_are_refused() -> None:
    text = textwrap.dedent("""\
        nodes:
          n1: {address: 127.0.0.1}
        containers:
          c1: {vmid: 101, node: n1, address: 127.0.0.5, service: {kind: ddtree, port: 8000}}
          c2: {vmid: 102, node: n1, address: 127.0.0.6, service: {kind: ddtree, port: 8000}}
          c3: {vmid: 103, node: n1, address: 127.0.0.5, service: {kind: ddtree, port: 8000}}
        local:
          a: {service: {kind: ddtree, port: 8000}}
          b: {service: {kind: ddtree, port: 8001}}
          c: {service: {kind: ddtree, port: 8000}}
        """)
    assert _errors(text) == [
        "inventory.yaml:6: containers.c3.service.port: port 8000 already used by c1 at 127.0.0.5 on node n1",
        "inventory.yaml:10: local.c.service.port: port 8000 already used by a on this machine"]


# ----------------------------------------------------------------------------- one pass, every value class

BROKEN = """\
nodes:
  pve1: {address: 10.0.0.1}
containers:
  ct1:
    vmid: 200
    node: pve2
    address: 10.0.0.5
    service: {kind: ddtree, port: 8000, colour: red}
  ct2:
    vmid: 200
    node: pve1
    address: 10.0.0.6
    service: {kind: ddtree, port: eighty}
  ct3:
    vmid: 200
    node: pve1
    address: 10.0.0.6
    service: {kind: ddtree, port: 8000, environment: {BAD-NAME: x}}
local:
  ct3:
    service: {kind: ddtree, port: 8411}
groups:
  web: [ct1, ct9]
"""


def test_schema_and_cross_reference_errors_in_one_pass() -> None:
    assert _errors(BROKEN) == [
        "inventory.yaml:6: containers.ct1.node: undefined node 'pve2'; did you mean 'pve1'?",
        "inventory.yaml:8: containers.ct1.service.colour: unknown key",
        "inventory.yaml:13: containers.ct2.service.port: Input should be a valid integer, not the string 'eighty'",
        "inventory.yaml:15: containers.ct3.vmid: vmid 200 already used by ct2 on node pve1",
        "inventory.yaml:18: containers.ct3.service.environment: 'BAD-NAME' is not a valid environment variable "
        "name (letters, digits, _)",
        "inventory.yaml:20: local.ct3: name already used under containers:",
        "inventory.yaml:23: groups.web[1]: unknown host 'ct9'; did you mean 'ct3'?",
    ]


def test_cli_prints_every_error_once_with_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ddtctl.cli.app import app

    bad = tmp_path / "fleet.yaml"
    bad.write_text(BROKEN)
    res = CliRunner().invoke(app, ["--inventory", str(bad), "inventory"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 7 and all(f"{bad}:" in ln for ln in lines), res.stderr
    assert "Value error" not in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("text", ["", "# nothing\n", "{}\n", "nodes: {pve1: {address: 10.0.0.1}}\n",
                                  "containers: {}\nlocal: {}\n"])
def test_an_inventory_without_hosts_is_an_error(text: str) -> None:
    (err,) = _errors(text)
    assert err.endswith("the inventory defines no hosts: add one under `containers:` or `local:`")


def _one_host(key: str, value: str, *, service: str = "", node: str = "") -> str:
    """A container entry with one setting replaced, and its node."""
    svc = {"kind": "ddtree", "port": "8000", "weights": "push"}
    ct = {"vmid": "200", "node": "pve1", "address": "10.0.0.5"}
    nd = {"address": "10.0.0.1"}
    target = ct if key in ct or key in ("root", "groups") else nd if node else svc
    target[key if not node else node] = value
    body = ", ".join(f"{k}: {v}" for k, v in svc.items()) + (f", {service}" if service else "")
    return ("nodes:\n  pve1: {" + ", ".join(f"{k}: {v}" for k, v in nd.items()) + "}\ncontainers:\n  ct1:\n"
            + "".join(f"    {k}: {v}\n" for k, v in ct.items()) + f"    service: {{{body}}}\n")


REFUSED = [
    # install roots: shell syntax of pip's /bin/sh launcher, venv's PATH separator, systemd
    ("root", '"/opt/a$b"', "containers.ct1.root", "contains '$'"),
    ("root", '"/opt/a`b`"', "containers.ct1.root", "contains '`'"),
    ("root", "'/opt/a\"b'", "containers.ct1.root", "contains '\"'"),
    ("root", '"/opt/a\'b"', "containers.ct1.root", "contains \"'\""),
    ("root", '"/opt/a\\\\b"', "containers.ct1.root", "contains '\\\\'"),
    ("root", '"/opt/a;b&c|d"', "containers.ct1.root", "contains '&' ';' '|'"),
    ("root", '"/opt/a(b)<c>"', "containers.ct1.root", "contains '(' ')' '<' '>'"),
    ("root", '"/opt/a*b?[c]"', "containers.ct1.root", "contains '*' '?' '[' ']'"),
    ("root", '"/opt/a:b"', "containers.ct1.root", "contains ':'"),
    ("root", '"/opt/a\\tb"', "containers.ct1.root", "contains '\\t'"),
    ("root", '"/opt/a\\nb"', "containers.ct1.root", "contains '\\n'"),
    ("root", '"/opt/caf\u00e9"', "containers.ct1.root", "contains 'é'"),
    ("root", "/opt/../etc", "containers.ct1.root", "must not contain `..` components"),
    ("root", "opt/ddtree", "containers.ct1.root", "must be an absolute path"),
    ("root", "/", "containers.ct1.root", "must be a folder below /"),
    ("root", '"/opt/ddtree "', "containers.ct1.root", "starts or ends with a space"),
    ("root", "/opt/" + "x" * 256, "containers.ct1.root", "longer than 255 bytes"),
    # model paths: argv words, push destinations, Proxmox mount options
    ("target", "{path: /models/../x}", "containers.ct1.service.target.path", "`..`"),
    ("target", '{path: "/models/a\\nb"}', "containers.ct1.service.target.path", "control character"),
    ("target", "{path: /}", "containers.ct1.service.target.path", "below /"),
    ("weights", "shared", "containers.ct1.service.target.path", "`,` and `=` are syntax"),
    # executables, addresses, GPUs, units, environment, names, numbers, JSON
    ("python", "'/usr/bin/py\"thon'", "containers.ct1.service.python", "quotes or backslashes"),
    ("python", '"python 3"', "containers.ct1.service.python", "absolute path or a command name"),
    ("address", '"10.0.0.5 "', "containers.ct1.address", "IP address or a host name"),
    ("address", "http://10.0.0.5", "containers.ct1.address", "IP address or a host name"),
    ("bind", '"0.0.0.0:80"', "containers.ct1.service.bind", "IP address or a host name"),
    ("gpus", '["0,1"]', "containers.ct1.service.gpus[0]", "joined with ','"),
    ("gpus", '["0 1"]', "containers.ct1.service.gpus[0]", "not a GPU index"),
    ("unit", "ddtree@.service", "containers.ct1.service.unit", "template unit"),
    ("environment", '{A: "x\\uFEFFy"}', "containers.ct1.service.environment.A", "U+FEFF"),
    ("environment", '{A: "x\\uFFFEy"}', "containers.ct1.service.environment.A", "noncharacter U+FFFE"),
    ("api_key_env", "MY-KEY", "containers.ct1.service.api_key_env", "not a valid environment variable name"),
    ("ready_timeout_s", ".inf", "containers.ct1.service.ready_timeout_s", "finite number"),
    ("model_id", '"a\\nb"', "containers.ct1.service.model_id", "control character"),
    ("groups", "['a,b']", "containers.ct1.groups[0]", "group names use letters"),
    ("extra_args", '["--x", "a\\0b"]', "containers.ct1.service.extra_args[1]", "NUL"),
]


@pytest.mark.parametrize(("key", "value", "path", "reason"), REFUSED,
                         ids=[f"{k}={v[:24]}" for k, v, *_ in REFUSED])
def test_values_that_cannot_deploy_are_refused_with_the_reason(key: str, value: str, path: str, reason: str) -> None:
    service = "target: {path: '/srv/models/a,b', source: /src/a}" if key == "weights" else ""
    errors = _errors(_one_host(key, value, service=service))
    assert len(errors) == 1 and f": {path}: " in errors[0] and reason in errors[0], errors
    assert "Value error" not in errors[0]


@pytest.mark.parametrize(("node_key", "value", "reason"), [
    ("models_root", '"/srv/a,b"', "`,` and `=` are syntax"),
    ("models_root", "srv/models", "absolute path"),
    ("address", '"pve 1"', "must not contain spaces"),
    ("ssh_options", "{Identity-File: /k}", "'Identity-File' is not an ssh_config keyword"),
    ("ssh_options", "{StrictHostKeyChecking: maybe}", "StrictHostKeyChecking 'maybe': use yes, accept-new, no, off, ask, strict"),
])
def test_node_values_that_cannot_work_are_refused(node_key: str, value: str, reason: str) -> None:
    (err,) = _errors(_one_host("", value, node=node_key).replace("\n    : " + value, ""))
    assert f"nodes.pve1.{node_key}" in err and reason in err, err


def test_accepted_values_are_normalised() -> None:
    text = _one_host("root", '"/opt//my dir/./x%y,z=w@v+u~t/"', service="target: {path: /models//q/}")
    ct = parse_inventory(text, Path("inventory.yaml")).hosts["ct1"]
    assert ct.root == "/opt/my dir/x%y,z=w@v+u~t" and ct.service.target.path == "/models/q"
    ok = parse_inventory(_one_host("ssh_options", "", node="ssh_options").replace(
        "ssh_options: }", "ssh_options: {StrictHostKeyChecking: yes}}"), Path("i.yaml"))
    assert ok.hosts["ct1"].node.ssh_options == {"StrictHostKeyChecking": "yes"}    # YAML `yes` is a boolean
    v6 = parse_inventory(_one_host("address", '"fd00::5"'), Path("i.yaml")).hosts["ct1"]
    assert v6.url == "http://[fd00::5]:8000/v1"


def test_local_roots(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DDTCTL_HOME", str(tmp_path / "state"))
    text = "local:\n  a: {root: ~/srv//a/, service: {kind: ddtree, port: 8000}}\n  b: {service: {kind: ddtree, port: 8001}}\n"
    inv = parse_inventory(text, Path("i.yaml"))
    assert inv.hosts["a"].root == str(tmp_path / "home" / "srv" / "a")
    assert inv.hosts["b"].root == str(tmp_path / "state" / "hosts" / "b")
    (err,) = _errors("local:\n  a: {root: srv/a, service: {kind: ddtree, port: 8000}}\n")
    assert "inventory.yaml:2: local.a.root: must be an absolute path or start with ~/" in err
    monkeypatch.setenv("DDTCTL_HOME", "/tmp/state:x")                # the default root comes from it
    (err,) = _errors("local:\n  b: {service: {kind: ddtree, port: 8001}}\n")
    assert err.startswith("inventory.yaml:2: local.b: the default root ($DDTCTL_HOME/hosts/<name>) "
                          "/tmp/state:x/hosts/b contains ':'"), err


def test_local_root_with_dot_dot_is_refused_not_resolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`..` in a local root is refused as for containers (docs/operations.md, "Values the inventory
    refuses"), not silently resolved: `/tmp/../etc` must not become an install root of `/etc`."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (err,) = _errors("local:\n  a: {root: /tmp/../etc, service: {kind: ddtree, port: 8000}}\n")
    assert err.startswith("inventory.yaml:2: local.a.root: root /tmp/../etc must not contain `..`"), err
    (err,) = _errors("local:\n  a: {root: ~/x/../../etc, service: {kind: ddtree, port: 8000}}\n")
    assert "local.a.root: root " in err and "must not contain `..`" in err, err


def test_keys_yaml_reads_as_booleans_or_numbers_name_their_own_line() -> None:
    """`yes:` / `200:` as a host name: the error is on the key's line, names the key as written and
    says how to quote it (was `local[1][key]` on another entry's line)."""
    errors = _errors("local:\n  200:\n    service: {kind: ddtree, port: 8000}\n"
                     "  yes:\n    service: {kind: ddtree, port: 8001}\n")
    assert ('inventory.yaml:2: local.200: names must be strings: YAML reads `200` as a number; '
            'quote it ("200")') in errors, errors
    assert ('inventory.yaml:4: local.yes: names must be strings: YAML reads `yes` as the boolean '
            'true; quote it ("yes")') in errors, errors


def test_nul_in_any_string_and_key() -> None:
    errors = _errors('local:\n  a:\n    service: {kind: ddtree, port: 8000, environment: {"A\\0": x}}\n'
                     '    groups: ["g\\0"]\n')
    assert errors == [
        "inventory.yaml:3: local.a.service.environment: unusable string: contains a NUL character (\\0), "
        "which no argv, path or file can carry",
        "inventory.yaml:4: local.a.groups[0]: unusable string: contains a NUL character (\\0), which no argv, "
        "path or file can carry"]


def test_shared_models_with_one_node_path_and_two_sources() -> None:
    text = textwrap.dedent("""\
        nodes:
          n1: {address: 10.0.0.1}
        containers:
          a: {vmid: 101, node: n1, address: 10.0.0.5, service: {kind: ddtree, port: 8000, weights: shared,
              target: {path: /models/q/model, source: /src/q/model}}}
          b: {vmid: 102, node: n1, address: 10.0.0.6, service: {kind: ddtree, port: 8000, weights: shared,
              target: {path: /models/q/model, source: /src/q/model}}}
          c: {vmid: 103, node: n1, address: 10.0.0.7, service: {kind: ddtree, port: 8000, weights: shared,
              target: {path: /models/r/model, source: /src/r/model}}}
        """)
    (err,) = _errors(text)
    assert err.startswith("inventory.yaml:9: containers.c.service.target.source: shared models of node n1 go to "
                          "/srv/ddtctl/models/model, which a.service.target fills from /src/q/model"), err


def test_a_bad_environment_name_is_reported_beside_a_boolean_value_of_the_same_map(tmp_path: Path) -> None:
    text = ("local:\n  here:\n    service:\n      kind: ddtree\n      port: 8000\n      environment:\n"
            "        GOOD: '1'\n        FLAG: true\n        BAD-NAME: x\n")
    with pytest.raises(InventoryError) as info:
        parse_inventory(text, tmp_path / "inventory.yaml")
    message = str(info.value)
    assert ":8: local.here.service.environment.FLAG: use a quoted string" in message
    assert ":9: local.here.service.environment: 'BAD-NAME' is not a valid environment variable name" in message
