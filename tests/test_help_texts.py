"""Every --help text of both command lines (ddtctl and ddtree-server): flags show as plain flags,
never with a `<bool>` value placeholder."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner


def _apps() -> dict[str, typer.Typer]:
    from ddtctl.cli.app import app as ddtctl_app
    from ddtree_server.cli import app as server_app
    return {"ddtctl": ddtctl_app, "ddtree-server": server_app}


def _command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """`path` and the paths of all its sub-commands, depth first (a group has `commands`; typer's
    command classes need not be click's own)."""
    paths = [path]
    for name, sub in getattr(command, "commands", {}).items():
        paths += _command_paths(sub, (*path, name))
    return paths


@pytest.mark.parametrize("name", ["ddtctl", "ddtree-server"])
def test_no_help_text_shows_a_bool_placeholder(name: str) -> None:
    app = _apps()[name]
    paths = _command_paths(typer.main.get_command(app))
    assert len(paths) > 4
    texts = {}
    for path in paths:
        res = CliRunner().invoke(app, [*path, "--help"], catch_exceptions=False)
        assert res.exit_code == 0, (path, res.output)
        texts[" ".join(path)] = res.stdout
    assert not [p for p, text in texts.items() if "<bool>" in text]
    assert all("--help  " in text or "--help\n" in text for text in texts.values())


def test_flags_read_as_flags() -> None:
    apps = _apps()
    deploy = CliRunner().invoke(apps["ddtctl"], ["deploy", "--help"]).stdout
    assert "-n, --dry-run  " in deploy and "--smoke / --no-smoke  " in deploy and "--json  " in deploy
    generate = CliRunner().invoke(apps["ddtree-server"], ["generate", "--help"]).stdout
    assert "--chat / --raw  " in generate and "--json  " in generate


@pytest.mark.parametrize("module", ["ddtree_server.bench", "ddtree_server.bench.exactness", "ddtree_server.train"])
def test_python_m_entry_points_use_plain_help(module: str) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout and "<bool>" not in out.stdout
