"""Unit rendering checked by the real systemd parser.

`systemd-analyze verify` must accept every rendered unit, and its debug dump ("Command Line:",
"Environment:") must give back exactly the argv and environment we meant, for hostile values
(`%s`, `100%FREE`, `$HOME`, quotes, spaces, backslashes, empty strings). EnvironmentFiles are
parsed by systemd's own env-file parser (the environment.d generator uses the same tokenizer).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from ddtctl.inventory import Host
from ddtctl.inventory_schema import Backend, DdtreeService, RouterService, SglangService, VllmService
from ddtctl.ops.units import (FIXED_ENV, env_file_value, render_env, render_unit, service_spec, systemd_arg,
                              systemd_env_assignment)

ANALYZE = shutil.which("systemd-analyze")
ENV_GENERATOR = Path("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")

HOSTILE = ["%s", "100%FREE", "$HOME", "${HOME}", "$$", "it's", 'say "hi"', "a b", "", "back\\slash",
           ";", "tab\there", "new\nline", "ünïcödé", "%%", "\\n", "-", "--flag=%i", "{\"a\": [1, 2]}"]


def _executable(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _dump(unit_dir: Path, unit_name: str, text: str) -> list[str]:
    """Write the unit, run the real `systemd-analyze verify`, return its debug dump lines."""
    unit = unit_dir / unit_name
    unit.write_text(text)
    quiet = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert unit_name not in quiet.stderr, quiet.stderr        # no warnings about our unit
    debug = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SYSTEMD_LOG_LEVEL": "debug"})
    return debug.stdout.splitlines() + debug.stderr.splitlines()


_C_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _split_dump(command_line: str) -> list[str]:
    """Undo systemd's quote_command_line(): bare words, or "double-quoted" ones with C escapes."""
    words, i = [], 0
    while i < len(command_line):
        if command_line[i] == " ":
            i += 1
            continue
        word, quoted = [], command_line[i] == '"'
        i += quoted
        while i < len(command_line) and (quoted or command_line[i] != " "):
            ch = command_line[i]
            if ch == "\\":
                nxt = command_line[i + 1]
                if nxt == "x":
                    word.append(chr(int(command_line[i + 2:i + 4], 16)))
                    i += 4
                    continue
                word.append(_C_ESCAPES.get(nxt, nxt))
                i += 2
                continue
            i += 1
            if quoted and ch == '"':
                break
            word.append(ch)
        words.append("".join(word))
    return words


def _exec_start(lines: list[str]) -> list[str]:
    """ExecStart argv as systemd will exec it: dump quoting undone, then `$$` -> `$`."""
    i = next(n for n, line in enumerate(lines) if line.strip() == "-> ExecStart:")
    command_line = lines[i + 1].strip().removeprefix("Command Line: ")
    return [word.replace("$$", "$") for word in _split_dump(command_line)]


def _environment(lines: list[str]) -> dict[str, str]:
    pairs = [line.strip().removeprefix("Environment: ") for line in lines
             if line.strip().startswith("Environment: ")]
    return dict(p.split("=", 1) for p in pairs)


def _hosts(tmp_path: Path) -> list[Host]:
    root = tmp_path / "r o%o$t"
    _executable(root / "current" / "venv" / "bin" / "ddtree-server")
    py = _executable(tmp_path / "py thon%s" / "python3")
    vllm = _executable(tmp_path / "v$llm" / "vllm")
    env = {"A": "x", "HOSTILE_1": "%s 100%FREE", "Q": "it's \"quoted\" back\\slash"}
    model = {"path": "/models/my model%s/Qwen3 $HOME", "source": None}
    drafter = {"path": "/models/dr'after"}
    common = dict(port=8411, gpus=[0, "1"], environment=env, extra_args=HOSTILE, model_id='m "id" 100%')
    return [
        Host("ct200", "container", "10.0.0.2", str(root),
             DdtreeService(kind="ddtree", target=model, drafter=drafter, mode="ddtree", tree_budget=64,
                           device="cuda", dtype="bf16", **common), node_name="pve1", vmid=200),
        Host("ct129", "container", "10.0.0.3", str(root),
             SglangService(kind="sglang", python=py, target=model, drafter=drafter, tp_size=2, block_size=16,
                           mamba_scheduler_strategy="extra_buffer", **common)),
        Host("ct130", "container", "10.0.0.4", str(root),
             VllmService(kind="vllm", executable=vllm, target=model, drafter=drafter, tp_size=2, block_size=16,
                         **common)),
        Host("ct210", "container", "10.0.0.10", str(root),
             RouterService(kind="router", backends="pool", port=30000, environment=env, extra_args=HOSTILE,
                           model_id='m "id" 100%', policy="round_robin"),
             backends=(Backend("ct200", "ddtree", "10.0.0.2", 8411, "m"), Backend("ct9", "ddtree", "fd00::9", 8000, "m"))),
    ]


@needs_analyze
@pytest.mark.parametrize("index", [0, 1, 2, 3], ids=["ddtree", "sglang-tp", "vllm-tp", "router"])
def test_rendered_units_parse_back_exactly(tmp_path: Path, index: int) -> None:
    host = _hosts(tmp_path)[index]
    _executable(Path(host.root) / "current" / "venv" / "bin" / "python")
    spec = service_spec(host)
    lines = _dump(tmp_path, host.unit, render_unit(spec))
    assert _exec_start(lines) == spec.argv
    gpus = {"CUDA_VISIBLE_DEVICES": "0,1"} if host.service.kind != "router" else {}
    assert _environment(lines) == {**FIXED_ENV, **gpus}
    dump = "\n".join(lines)
    assert f"WorkingDirectory: {host.root}\n" in dump
    assert f"EnvironmentFile: -{host.root}/{host.unit.removesuffix('.service')}.env" in dump
    assert spec.argv[-len(HOSTILE):] == HOSTILE


@needs_analyze
def test_unit_settings(tmp_path: Path) -> None:
    ddtree, sglang, _, _ = (service_spec(h) for h in _hosts(tmp_path))
    text = render_unit(ddtree)
    for line in ("Type=notify", "NotifyAccess=main", "TimeoutStartSec=30min", "Restart=on-failure",
                 "RestartSec=10", "KillMode=control-group", "TimeoutStopSec=150", "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in text
    assert "\nType=exec\n" in render_unit(sglang) and "Type=notify" not in render_unit(sglang)


def test_argv_of_each_engine(tmp_path: Path) -> None:
    ddtree, sglang, vllm, router = (service_spec(h) for h in _hosts(tmp_path))
    assert ddtree.argv[1:3] == ["serve", "--host"]
    i = ddtree.argv.index("--target")
    assert ddtree.argv[i:i + 4] == ["--target", "/models/my model%s/Qwen3 $HOME", "--drafter", "/models/dr'after"]
    assert sglang.argv[1:5] == ["-m", "sglang.launch_server", "--model-path", "/models/my model%s/Qwen3 $HOME"]
    i = sglang.argv.index("--speculative-algorithm")
    assert sglang.argv[i:i + 4] == ["--speculative-algorithm", "DFLASH",
                                    "--speculative-draft-model-path", "/models/dr'after"]
    assert vllm.argv[1:3] == ["serve", "/models/my model%s/Qwen3 $HOME"]
    i = vllm.argv.index("--speculative-config")
    assert vllm.argv[i + 1] == '{"method":"dflash","model":"/models/dr\'after","num_speculative_tokens":15}'
    i = sglang.argv.index("--tp-size")
    assert sglang.argv[i:i + 2] == ["--tp-size", "2"]
    assert sglang.argv[sglang.argv.index("--speculative-num-draft-tokens") + 1] == "16"
    assert sglang.argv[sglang.argv.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert vllm.argv[vllm.argv.index("--tensor-parallel-size") + 1] == "2"
    assert router.argv[1:3] == ["-m", "sglang_router.launch_router"]
    i = router.argv.index("--worker-urls")
    assert router.argv[i:i + 4] == ["--worker-urls", "http://10.0.0.2:8411", "http://[fd00::9]:8000", "--policy"]
    assert router.argv[router.argv.index("--health-check-endpoint") + 1] == "/ready"
    assert "--disable-circuit-breaker" in router.argv


def test_filters_escape() -> None:
    assert systemd_arg("plain-1.0") == "plain-1.0"
    assert systemd_arg("100%FREE") == "100%%FREE"
    assert systemd_arg("$HOME") == '"$$HOME"'
    assert systemd_arg("") == '""'
    assert systemd_arg('a "b"') == '"a \\"b\\""'
    assert systemd_env_assignment(("K", "50% of $X")) == '"K=50%% of $X"'
    assert env_file_value("plain") == "plain"
    assert env_file_value("$HOME `x` \"q\" \\") == '"\\$HOME \\`x\\` \\"q\\" \\\\"'


@pytest.mark.skipif(not ENV_GENERATOR.exists(), reason="systemd environment.d generator not installed")
def test_env_file_parsed_by_systemd(tmp_path: Path) -> None:
    """systemd's env-file tokenizer gives back every value (`$` is checked in test_filters_escape:
    the environment.d generator expands `$VAR`, EnvironmentFile= does not)."""
    values = {f"V{i}": v for i, v in enumerate(HOSTILE) if "$" not in v and v}
    host = _hosts(tmp_path)[0]
    spec = service_spec(host.__class__(**{**host.__dict__, "service": host.service.model_copy(
        update={"environment": values})}))
    conf = tmp_path / "xdg" / "environment.d"
    conf.mkdir(parents=True)
    (conf / "50-ddtctl.conf").write_text(render_env(spec))
    out = subprocess.run([str(ENV_GENERATOR)], capture_output=True, text=True, timeout=30,
                         env={"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    parsed = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in values:
            parsed[key] = _split_dump(value)[0]
    assert parsed == values
    assert env_file_value("") == '""'        # the generator drops empty values; EnvironmentFile= keeps them
