"""Pure tests of the argv builders, the serialiser, Result and the error table (no I/O)."""

from __future__ import annotations

import shlex

import pytest

from ddtctl.errors import (ArgvError, ExitCode, HostKeyError, RemoteError, TransferError,
                           UnreachableError, UsageError, exit_code_for)
from ddtctl.remote.command import (LXC_DEFAULT_PATH, bash_script, display, pct_exec, pct_push,
                                   shell_join, with_env)
from ddtctl.remote.push import parse_sha256sum, resume_offset
from ddtctl.remote.result import Result

ENV_I = ["/usr/bin/env", "-i", "HOME=/root", "LANG=C.UTF-8", "LC_ALL=C.UTF-8",
         f"PATH={LXC_DEFAULT_PATH}"]


def test_pct_exec_exact_form():
    assert pct_exec(200, ["nvidia-smi", "--query-gpu=name", "--format=csv"]) == [
        "pct", "exec", "200", "--keep-env", "0", "--", *ENV_I,
        "nvidia-smi", "--query-gpu=name", "--format=csv"]


def test_pct_exec_env_after_base_so_it_can_override():
    argv = pct_exec("201", ["python3", "-V"], env={"PATH": "/opt/venv/bin:/usr/bin", "X": "a b"})
    assert argv[-4:] == ["PATH=/opt/venv/bin:/usr/bin", "X=a b", "python3", "-V"]
    assert argv.index("--") == 5


def test_pct_exec_keep_env_has_no_env_i():
    assert pct_exec(200, ["ls", "-la"], keep_env=True) == [
        "pct", "exec", "200", "--keep-env", "1", "--", "ls", "-la"]
    assert pct_exec(200, ["id"], keep_env=True, env={"A": "1"}) == [
        "pct", "exec", "200", "--keep-env", "1", "--", "/usr/bin/env", "A=1", "id"]


@pytest.mark.parametrize("argv", [[], "ls -la", b"ls", ["ls", None], ["a\x00b"]])
def test_pct_exec_refuses_bad_argv(argv):
    with pytest.raises(ArgvError):
        pct_exec(200, argv)


@pytest.mark.parametrize("vmid", [99, "abc", "200; rm -rf /", 10**10, "-1"])
def test_pct_exec_refuses_bad_vmid(vmid):
    with pytest.raises(ArgvError):
        pct_exec(vmid, ["true"])


@pytest.mark.parametrize("env", [{"A B": "1"}, {"1A": "x"}, {"A": "x\x00"}, {"": "x"}])
def test_env_validation(env):
    with pytest.raises(ArgvError):
        pct_exec(200, ["true"], env=env)


def test_program_name_that_env_would_misread_is_refused():
    with pytest.raises(ArgvError):
        pct_exec(200, ["A=B", "x"])
    with pytest.raises(ArgvError):
        with_env(["-i", "x"], {"A": "1"})
    assert with_env(["ls"], None) == ["ls"]


def test_pct_push_forms():
    assert pct_push(200, "/tmp/s", "/opt/a b/c") == ["pct", "push", "200", "/tmp/s", "/opt/a b/c"]
    assert pct_push(200, "/tmp/s", "/etc/x", perms=0o640, user="ddt", group=0) == [
        "pct", "push", "200", "/tmp/s", "/etc/x", "--perms", "640", "--user", "ddt",
        "--group", "0"]
    assert pct_push(200, "/s", "/d", perms="0x1a4")[-1] == "0x1a4"


@pytest.mark.parametrize("src,dest,perms", [("rel", "/d", None), ("/s", "d", None),
                                            ("/s", "/dir/", None), ("/s", "/d", "rw"),
                                            ("-x", "/d", None), ("/s", "/d\x00", None)])
def test_pct_push_refusals(src, dest, perms):
    with pytest.raises(ArgvError):
        pct_push(200, src, dest, perms=perms)


def test_bash_script_values_are_positional():
    script = 'printf "%s\\n" "$1" "$2"'
    assert bash_script(script, "a'b", "$(x)") == ["bash", "-lc", script, "ddtctl", "a'b", "$(x)"]
    with pytest.raises(ArgvError):
        bash_script("  ")


TRICKY = ["", " ", "a b", "'", '"', "$HOME", "$(id)", "`id`", "\\", "%s%%", "*", "\n", "-la",
          "--", "é€😀", "a'\"b", "\t\r", "!x", "~", "#c", ";|&<>"]


def test_shell_join_round_trips_through_posix_split():
    assert shlex.split(shell_join(TRICKY)) == TRICKY


def test_shell_join_rejects_nul_with_clear_error():
    with pytest.raises(ArgvError, match=r"argv\[1\] contains a NUL byte"):
        shell_join(["echo", "a\x00b"])


def test_nothing_joins_with_spaces():
    argv = pct_exec(200, ["grep", "x y", "file"])
    assert shlex.split(shell_join(argv))[-3:] == ["grep", "x y", "file"]


def test_display_masks_secrets_before_quoting():
    shown = display(["curl", "-H", "Authorization: Bearer s'cr3t", "--token=s'cr3t"], ["s'cr3t", ""])
    assert "cr3t" not in shown and shown.count("***") == 2
    assert shlex.split(shown) == ["curl", "-H", "Authorization: Bearer ***", "--token=***"]


def test_result_check_and_quoting_bug_hint():
    ok = Result(("true",), 0, b"", b"", 0.01, "local")
    assert ok.check() is ok and ok.ok
    bad = Result(("bash", "-c", "x"), 2, b"", b"bash: -c: line 1: unexpected EOF while looking "
                 b"for matching `''\n", 0.01, "ct200@pve1")
    assert bad.quoting_bug
    with pytest.raises(RemoteError, match="quoting bug in ddtctl") as info:
        bad.check()
    assert info.value.result is bad and "ct200@pve1" in str(info.value)
    assert Result(("x",), 0, "é".encode(), b"\xff", 0, "").err_text == "\ufffd"


def test_exit_code_table():
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 5, 130]
    assert UsageError.exit_code == 2 and ArgvError.exit_code == 2
    assert HostKeyError.exit_code == UnreachableError.exit_code == 3
    assert TransferError("x").exit_code == 1
    assert issubclass(ArgvError, ValueError)
    assert exit_code_for([]) == 0
    assert exit_code_for([RemoteError("a"), HostKeyError("b"), KeyError()]) == 3
    from ddtctl.cancel import Interrupted

    assert Interrupted("x").exit_code == 130 and exit_code_for([RemoteError("a"), Interrupted("b")]) == 130


def test_resume_decision():
    assert resume_offset(None, 100, lambda: True) == 0
    assert resume_offset(0, 100, lambda: True) == 0
    assert resume_offset(40, 100, lambda: True) == 40
    assert resume_offset(40, 100, lambda: False) == 0
    assert resume_offset(101, 100, lambda: True) == 0
    assert resume_offset(100, 100, lambda: True) == 100


def test_parse_sha256sum():
    digest = "a" * 64
    assert parse_sha256sum(f"{digest}  /x\n".encode()) == digest
    assert parse_sha256sum(f"\\{digest}  /a\\nb\n".encode()) == digest
    with pytest.raises(ValueError):
        parse_sha256sum(b"sha256sum: /x: No such file or directory\n")
