"""Every --help text of both command lines (ddtctl and ddtree-server): flags show as plain flags,
and no argument or option shows a Typer type placeholder (`<bool>`, `<list[str]>`,
`<float range>`, ...); ddtctl takes `--inventory` before or after the command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner



def placeholders(text: str) -> list[str]:
    """`<...>` in the first column of argument/option lines (`  --timeout <float range>  help`);
    angle brackets in the help text itself (e.g. `<name>`) do not count."""
    found = []
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            first_column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            found += re.findall(r"<[^<>]+>", first_column)
    return found


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
    shown = {p: placeholders(text) for p, text in texts.items()}
    assert not {p: m for p, m in shown.items() if m}, "Typer type placeholders in --help"


def test_flags_read_as_flags() -> None:
    apps = _apps()
    deploy = CliRunner().invoke(apps["ddtctl"], ["deploy", "--help"]).stdout
    assert "-n, --dry-run  " in deploy and "--smoke / --no-smoke  " in deploy and "--json  " in deploy
    generate = CliRunner().invoke(apps["ddtree-server"], ["generate", "--help"]).stdout
    assert "--chat / --raw  " in generate and "--json  " in generate


@pytest.mark.parametrize("module", ["ddtree_server.bench", "ddtree_server.bench.exactness", "ddtree_server.train"])
def test_python_m_entry_points_use_plain_help(module: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout and "<bool>" not in out.stdout
    assert not placeholders(out.stdout), placeholders(out.stdout)


def test_placeholders_become_click_style_metavars() -> None:
    apps = _apps()
    deploy = CliRunner().invoke(apps["ddtctl"], ["deploy", "--help"]).stdout
    assert "  [HOST|GROUP]...  Host or group names" in deploy
    assert "--timeout SECONDS" in deploy and "-p, --parallel INTEGER" in deploy
    exec_help = CliRunner().invoke(apps["ddtctl"], ["exec", "--help"]).stdout
    assert "  HOST " in exec_help and "-- ARGV...  Command and arguments." in exec_help
    generate = CliRunner().invoke(apps["ddtree-server"], ["generate", "--help"]).stdout
    assert "--temperature FLOAT" in generate and "--stop TEXT" in generate and "--gguf PATH" in generate


def test_dry_run_help_says_it_connects_to_the_hosts() -> None:
    deploy = " ".join(CliRunner().invoke(_apps()["ddtctl"], ["deploy", "--help"]).stdout.split())
    assert "change nothing. Still connects to the hosts to read what is there" in deploy
    assert "like Ansible's check mode" in deploy


def test_inventory_is_taken_after_the_command_too(tmp_path: Path) -> None:
    from ddtctl.cli.app import hoist_inventory

    good = Path(__file__).resolve().parents[1] / "examples" / "proxmox-fleet.yaml"
    bad = tmp_path / "bad.yaml"
    bad.write_text("local: {}\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "ddtctl", *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1"})
    after = run("inventory", "--json", "--inventory", str(good))
    assert after.returncode == 0 and '"ct200"' in after.stdout, after.stderr
    assert run("-i", str(bad), "inventory", "-i", str(good)).returncode == 0       # the later one wins
    failed = run("inventory", f"--inventory={bad}")
    assert failed.returncode == 2 and "the inventory defines no hosts" in failed.stderr
    assert hoist_inventory(["status", "--all", "-i", "f.yaml"]) == ["-i", "f.yaml", "status", "--all"]
    assert hoist_inventory(["exec", "ct200", "--", "grep", "-i", "x"]) == ["exec", "ct200", "--", "grep", "-i", "x"]
    assert hoist_inventory(["exec", "ct200", "grep", "-i", "x"]) == ["exec", "ct200", "grep", "-i", "x"]
