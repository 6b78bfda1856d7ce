"""A router's release: what pip installs in each `packages:` mode, and that any change of the install
settings names a new release (installed beside the running one, never over it)."""

from __future__ import annotations

from pathlib import Path

from ddtctl.inventory import parse_inventory
from ddtctl.ops import router_release

INVENTORY = """
nodes:
  pve1: {address: 127.0.0.1}
containers:
  b1: {vmid: 201, node: pve1, address: 10.9.0.1, groups: [pool], service: {kind: ddtree, port: 8000}}
  r1:
    vmid: 210
    node: pve1
    address: 10.9.0.10
    service: {kind: router, port: 30000, backends: pool, packages: PACKAGES}
"""


def _router(packages: str = "{mode: index}"):
    return parse_inventory(INVENTORY.replace("PACKAGES", packages), Path("inv.yaml")).hosts["r1"]


def test_each_mode_installs_the_pinned_router() -> None:
    index = router_release.plan(_router("{mode: index, extra_index_urls: [https://m.example/simple]}"),
                                "python3", "/opt/ddtree/wheelhouse")
    assert (index.venv_args, index.pip_installs) == (
        [], [["--extra-index-url", "https://m.example/simple", "sglang-router==0.3.2"]])
    house = router_release.plan(_router("{mode: wheelhouse}"), "python3", "/opt/ddtree/wheelhouse", ["a.whl"])
    assert house.pip_installs == [["--no-index", "--find-links", "/opt/ddtree/wheelhouse", "sglang-router==0.3.2"]]
    assert house.fingerprint["wheels"] == ["a.whl"]
    system = router_release.plan(_router("{mode: system}"), "/usr/bin/python3", "/w")
    assert (system.venv_args, system.pip_installs) == (
        ["--system-site-packages", "--without-pip"], [["--no-index", "--no-deps", "sglang-router==0.3.2"]])


def test_release_id_follows_the_install_settings() -> None:
    rid = router_release.release_id(_router(), "python3")
    assert rid.startswith("sglang-router-0.3.2-") and len(rid) == len("sglang-router-0.3.2-") + 12
    assert rid == router_release.release_id(_router(), "python3")
    others = {router_release.release_id(_router("{mode: system}"), "python3"),
              router_release.release_id(_router(), "/usr/bin/python3.12"),
              router_release.release_id(_router("{mode: index, pip_args: [--pre]}"), "python3")}
    assert rid not in others and len(others) == 3
