"""The systemctl/journalctl emulations run as subprocesses against real unit files and a real service.

What is checked is the behaviour of systemctl(1), systemd.service(5), systemd.exec(5),
systemd.kill(5) and journalctl(1) that ddtctl relies on (docs/operations.md §13.5): job waiting
per Type=, exit codes, Restart= and the start rate limit as systemd 252 applies it, stop timeouts,
environment/specifier/`$` handling, daemon-reload.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.fleet.emu import ratelimit
from tests.fleet.emu.paths import Paths
from tests.fleet.emu.state import kill_all
from tests.fleet.emu_helpers import Emu, alive

NOTIFY = """[Unit]
Description=Notify test
[Service]
Type=notify
ExecStart=@SVC@ ready=0.4
[Install]
WantedBy=multi-user.target
"""


@pytest.fixture
def emu(tmp_path):
    e = Emu(tmp_path / "root")
    yield e
    kill_all(Paths(e.root), timeout=5)


def test_notify_start_waits_for_ready_and_leaves_caller_stdio_alone(emu):
    emu.unit("n.service", NOTIFY)
    t0 = time.monotonic()
    res = emu.ctl("start", "n")                    # capture_output: returns only at EOF of the pipes
    assert res.returncode == 0, res.stderr
    assert 0.4 <= time.monotonic() - t0 < 10
    props = emu.show("n.service")
    assert (props["ActiveState"], props["SubState"], props["Result"]) == ("active", "running", "success")
    assert alive(int(props["MainPID"])) and props["StatusText"] == "serving"
    assert emu.ctl("is-active", "n").stdout == "active\n"
    status = emu.ctl("status", "n.service")
    assert status.returncode == 0 and "Active: active (running)" in status.stdout
    assert 'Status: "serving"' in status.stdout and "Started Notify test." in status.stdout
    again = emu.ctl("start", "n")                   # already active: no new process
    assert again.returncode == 0 and emu.show("n.service")["MainPID"] == props["MainPID"]


def test_show_value_prints_in_systemd_order_not_request_order(emu):
    emu.unit("n.service", NOTIFY)
    assert emu.ctl("start", "n").returncode == 0
    out = emu.ctl("show", "n", "-p", "ActiveState,SubState,Result,NRestarts,MainPID,ExecMainStatus",
                  "--value").stdout.splitlines()
    assert out[0].isdigit() and out[1:] == ["success", "0", "0", "active", "running"]


def test_environment_is_clean_and_expanded_like_systemd(emu, tmp_path):
    env_file = tmp_path / "svc.env"
    env_file.write_text('# comment\nA="from file"\nD=\'$HOME %n\'\n')
    conf = emu.root / "etc" / "systemd" / "system.conf"       # the manager's DefaultEnvironment=
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text('[Manager]\n#DefaultEnvironment=G=no\nDefaultEnvironment="F=from manager" A=manager\n')
    emu.unit("e.service", f"""[Service]
Type=exec
WorkingDirectory=/tmp
Environment="A=x y" B=%n C=$$lit "E=100%%"
EnvironmentFile=-/nonexistent/optional.env
EnvironmentFile={env_file}
ExecStart=@SVC@ ${{A}} $A "$${{HOME}}" 100%% %N \\x41\\t ""
""")
    assert emu.ctl("start", "e").returncode == 0
    for _ in range(100):
        if any(line.startswith("{") for line in emu.journal("e")):
            break
        time.sleep(0.05)
    seen = emu.first_json("e.service")
    assert seen["argv"] == ["from file", "from", "file", "${HOME}", "100%", "e", "A\t", ""]
    env = seen["env"]
    assert (env["A"], env["B"], env["C"], env["D"], env["E"]) == ("from file", "e.service", "$$lit",
                                                                   "$HOME %n", "100%")
    assert env["F"] == "from manager" and "G" not in env      # the unit's own A= wins
    assert "DDT_LEAK" not in env and env["PATH"].startswith("/usr/local/sbin") and env["INVOCATION_ID"]
    assert seen["cwd"] == "/tmp"


def test_missing_executable_fails_exec_unit_with_203(emu):
    emu.unit("x.service", "[Service]\nType=exec\nExecStart=/nonexistent/bin/server --flag\n")
    res = emu.ctl("start", "x")
    assert res.returncode == 1
    assert "Job for x.service failed because the control process exited with error code." in res.stderr
    props = emu.show("x.service")
    assert (props["ActiveState"], props["Result"], props["ExecMainStatus"]) == ("failed", "exit-code", "203")
    assert any("Failed at step EXEC spawning /nonexistent/bin/server" in line for line in emu.journal("x"))
    assert emu.ctl("is-failed", "x").returncode == 0


def test_crash_loop_hits_the_start_limit_keeping_the_failed_runs_result(emu):
    """systemd 252: a Restart= loop refused by the start limit ends failed with the crash's
    Result (exit-code), not start-limit-hit; the journal says why; a manual start is refused too
    (exit 1, the message for Result=exit-code); reset-failed clears it and the next start runs."""
    emu.unit("c.service", """[Unit]
Description=Crasher
StartLimitIntervalSec=60
StartLimitBurst=3
[Service]
Type=notify
ExecStart=@SVC@ exit=1
Restart=on-failure
RestartSec=100ms
""")
    res = emu.ctl("start", "c")          # the job fails with the first attempt; restarts go on
    assert res.returncode == 1 and "the control process exited with error code" in res.stderr
    deadline = time.monotonic() + 20
    while emu.show("c.service")["ActiveState"] != "failed" and time.monotonic() < deadline:
        time.sleep(0.05)
    props = emu.show("c.service")
    assert (props["ActiveState"], props["Result"], props["NRestarts"]) == ("failed", "exit-code", "3")
    log = emu.journal("c")
    assert log.count("exiting 1") == 3 and "c.service: Main process exited, code=exited, status=1/FAILURE" in log
    limit = log.index("c.service: Start request repeated too quickly.")
    assert log[limit + 1:limit + 3] == ["c.service: Failed with result 'exit-code'.", "Failed to start Crasher."]
    again = emu.ctl("start", "c")                          # still rate limited: refused, nothing runs
    assert again.returncode == 1 and again.stderr.startswith(
        "Job for c.service failed because the control process exited with error code.\n")
    assert "reset-failed" not in again.stderr and emu.journal("c").count("exiting 1") == 3
    assert emu.ctl("reset-failed", "c").returncode == 0
    props = emu.show("c.service")
    assert (props["ActiveState"], props["Result"], props["NRestarts"]) == ("inactive", "success", "0")
    assert emu.ctl("start", "c").returncode == 1             # allowed again: it runs (and crashes)
    assert emu.journal("c").count("exiting 1") > 3


def test_restarting_a_healthy_unit_too_often_is_start_limit_hit(emu):
    """Default limit (10 s / 5 starts): the 6th start within the window is refused; the unit was
    stopped cleanly, so Result=start-limit-hit; systemctl 252 prints the plain job failure.

    Six starts (six systemctl processes, each stopping and starting a service) fit in 10 s on an
    idle machine, not always on a loaded one. An attempt whose 6th start is accepted must have had
    the window reopened (a start more than 10 s after the window's first one, at most 5 starts in
    the new window): the emulation checked, it is run again after a reset-failed. Otherwise, or
    when no attempt fits, it fails."""
    emu.unit("q.service", "[Unit]\nDescription=Quick\n[Service]\nType=exec\nExecStart=@SVC@\n")
    paths = Paths(emu.root)
    for _attempt in range(4):
        assert emu.ctl("start", "q").returncode == 0
        first = ratelimit.snapshot(paths, "q.service")
        assert first["num"] == 1                                  # the window opened at this start
        for _ in range(4):
            assert emu.ctl("restart", "q").returncode == 0
        res = emu.ctl("restart", "q")
        if res.returncode != 0:
            break
        window = ratelimit.snapshot(paths, "q.service")       # accepted: only in a later window
        assert window["begin"] - first["begin"] > 10 and window["num"] <= 5, (first, window)
        assert emu.ctl("stop", "q").returncode == 0 and emu.ctl("reset-failed", "q").returncode == 0
    else:
        pytest.fail("six starts never came within 10 s of each other: the machine is too slow for this test")
    assert res.returncode == 1
    assert res.stderr == ('Job for q.service failed.\nSee "systemctl status q.service" and '
                          '"journalctl -xeu q.service" for details.\n')
    props = emu.show("q.service")
    assert (props["ActiveState"], props["SubState"], props["Result"]) == ("failed", "failed", "start-limit-hit")
    assert props["MainPID"] == "0" and emu.ctl("is-failed", "q").returncode == 0
    assert "Active: failed (Result: start-limit-hit)" in emu.ctl("status", "q").stdout
    assert emu.journal("q")[-3:] == ["q.service: Start request repeated too quickly.",
                                     "q.service: Failed with result 'start-limit-hit'.", "Failed to start Quick."]
    assert emu.ctl("start", "q").returncode == 1             # a plain start is refused as well
    assert emu.ctl("reset-failed", "q").returncode == 0
    assert emu.ctl("start", "q").returncode == 0 and emu.show("q")["ActiveState"] == "active"


def test_daemon_reload_forgets_the_start_limit_as_in_252(emu):
    emu.unit("q.service", "[Unit]\nStartLimitBurst=1\n[Service]\nType=exec\nExecStart=@SVC@\n")
    assert emu.ctl("start", "q").returncode == 0
    assert emu.ctl("restart", "q").returncode == 1 and emu.show("q")["Result"] == "start-limit-hit"
    assert emu.ctl("daemon-reload").returncode == 0          # 252 re-creates units: fresh rate limit
    assert emu.ctl("start", "q").returncode == 0


def test_reset_failed_of_a_running_unit_zeroes_nrestarts_and_a_missing_unit_exits_1(emu):
    emu.unit("r.service", "[Service]\nType=exec\nExecStart=@SVC@ exit=3 delay=0.3\n"
                          "Restart=on-failure\nRestartSec=0.2\nStartLimitBurst=50\n")
    assert emu.ctl("start", "r").returncode == 0
    deadline = time.monotonic() + 20
    while int(emu.show("r")["NRestarts"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    res = emu.ctl("reset-failed", "r", "nope")
    assert res.returncode == 1
    assert res.stderr == "Failed to reset failed state of unit nope.service: Unit nope.service not loaded.\n"
    assert int(emu.show("r")["NRestarts"]) <= 1                # r was reset (a restart may follow)
    assert emu.ctl("stop", "r").returncode == 0


def test_start_rate_limit_is_a_fixed_window(tmp_path):
    """ratelimit_below(): the window opens at the first start and reopens only after the interval,
    refused starts count too (a sliding window would refuse the start at t=10.5)."""
    paths, unit = Paths(tmp_path), {"id": "w.service", "start_limit_interval": 10.0, "start_limit_burst": 2}
    verdicts = [ratelimit.start_allowed(paths, unit, now=t) for t in (100.0, 109.0, 109.5, 110.5, 110.6, 110.7)]
    assert verdicts == [True, True, False, True, True, False]
    assert ratelimit.snapshot(paths, "w.service") == {"begin": 110.5, "num": 3}
    ratelimit.reset(paths, "w.service")
    assert ratelimit.start_allowed(paths, unit, now=110.8)
    assert ratelimit.start_allowed(paths, {**unit, "start_limit_burst": 0}, now=110.9)   # 0 disables it


def test_restart_on_failure_counts_nrestarts_with_new_main_pids(emu):
    emu.unit("r.service", "[Service]\nType=exec\nExecStart=@SVC@ exit=3 delay=1\n"
                          "Restart=on-failure\nRestartSec=0.1\nStartLimitBurst=50\n")
    assert emu.ctl("start", "r").returncode == 0
    pids = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (int(emu.show("r.service")["NRestarts"]) < 2 or len(pids - {"0"}) < 2):
        pids.add(emu.show("r.service")["MainPID"])          # each run lives 1 s: sampling sees it
        time.sleep(0.05)
    assert int(emu.show("r.service")["NRestarts"]) >= 2 and len(pids - {"0"}) >= 2
    assert emu.ctl("stop", "r").returncode == 0
    assert emu.show("r.service")["ActiveState"] in ("inactive", "failed")


def test_stop_timeout_sigkills_the_whole_control_group(emu):
    emu.unit("s.service", "[Service]\nType=exec\nExecStart=@SVC@ ignore_term=1 child=1\nTimeoutStopSec=1\n")
    assert emu.ctl("start", "s").returncode == 0
    for _ in range(100):
        child = [line for line in emu.journal("s") if line.startswith("child=")]
        if child:
            break
        time.sleep(0.05)
    child_pid, main_pid = int(child[0].split("=")[1]), int(emu.show("s.service")["MainPID"])
    t0 = time.monotonic()
    assert emu.ctl("stop", "s").returncode == 0
    assert 0.9 < time.monotonic() - t0 < 15
    assert not alive(child_pid) and not alive(main_pid)
    props = emu.show("s.service")
    assert (props["ActiveState"], props["Result"]) == ("failed", "timeout")
    assert "s.service: State 'stop-sigterm' timed out. Killing." in emu.journal("s")


def test_changed_unit_needs_daemon_reload(emu):
    path = emu.unit("d.service", "[Unit]\nDescription=old\n[Service]\nExecStart=@SVC@\n")
    assert emu.ctl("start", "d").returncode == 0
    time.sleep(0.01)
    path.write_text(path.read_text().replace("Description=old", "Description=new"))
    res = emu.ctl("restart", "d")
    assert res.returncode == 0 and "changed on disk. Run 'systemctl daemon-reload'" in res.stderr
    assert (emu.show("d")["Description"], emu.show("d")["NeedDaemonReload"]) == ("old", "yes")
    assert emu.ctl("daemon-reload").returncode == 0
    assert (emu.show("d")["Description"], emu.show("d")["NeedDaemonReload"]) == ("new", "no")


@pytest.mark.parametrize("argv,code,stream,text", [
    (["start", "nope"], 5, "stderr", "Failed to start nope.service: Unit nope.service not found.\n"),
    (["stop", "nope"], 5, "stderr", "Failed to stop nope.service: Unit nope.service not loaded.\n"),
    (["status", "nope"], 4, "stderr", "Unit nope.service could not be found.\n"),
    (["is-active", "nope"], 3, "stdout", "inactive\n"),
    (["is-failed", "nope"], 1, "stdout", "inactive\n"),
    (["is-enabled", "nope"], 4, "stdout", "not-found\n"),
    (["is-system-running"], 0, "stdout", "running\n"),
    (["frobnicate", "x"], 1, "stderr", "Unknown command verb 'frobnicate'.\n"),
    (["--frob", "start", "x"], 1, "stderr", "systemctl: unrecognized option '--frob'\n"),
])
def test_exit_codes_and_messages(emu, argv, code, stream, text):
    res = emu.ctl(*argv)
    assert (res.returncode, getattr(res, stream)) == (code, text)
    assert emu.show("nope")["LoadState"] == "not-found"


def test_bad_unit_settings_refuse_to_start_with_exit_6(emu):
    emu.unit("b.service", "[Service]\nExecStart=/bin/echo %z\n")
    res = emu.ctl("start", "b")
    assert res.returncode == 6 and "has a bad unit file setting" in res.stderr
    assert emu.show("b")["LoadState"] == "bad-setting"


def test_enable_disable_and_is_enabled(emu):
    emu.unit("n.service", NOTIFY)
    emu.unit("static.service", "[Service]\nExecStart=/bin/true\n")
    assert emu.ctl("is-enabled", "n").stdout == "disabled\n"
    res = emu.ctl("enable", "n")
    assert res.stderr == ("Created symlink /etc/systemd/system/multi-user.target.wants/n.service "
                          "→ /etc/systemd/system/n.service.\n")
    assert (emu.unit_dir / "multi-user.target.wants/n.service").is_symlink()
    assert (emu.ctl("is-enabled", "n").returncode, emu.ctl("is-enabled", "static").stdout) == (0, "static\n")
    assert emu.ctl("disable", "--now", "n").returncode == 0
    assert emu.ctl("is-enabled", "n").returncode == 1


def test_journalctl_formats_and_line_limits(emu):
    emu.unit("n.service", NOTIFY)
    assert emu.ctl("start", "n").returncode == 0
    cat = emu.journal("n")
    assert cat[0] == "Starting Notify test..." and cat[-1] == "Started Notify test."
    assert emu.journal("n", "-n", "1") == ["Started Notify test."]
    short = emu.run("journalctl", "-xeu", "n.service", "-n2").stdout.splitlines()
    assert len(short) == 2
    assert re.match(r"^[A-Z][a-z]{2} \d\d \d\d:\d\d:\d\d \S+ systemd\[1\]: Started Notify test\.$", short[1])
    assert emu.run("journalctl", "-u", "other", "--no-pager").stdout == "-- No entries --\n"
    assert emu.run("journalctl", "-f").returncode == 1


def test_automatic_restart_uses_the_unit_as_reloaded(emu):
    path = emu.unit("a.service", "[Service]\nType=notify\nExecStart=@SVC@ exit=1\n"
                                 "Restart=on-failure\nRestartSec=1\nStartLimitBurst=100\n")
    assert emu.ctl("start", "a").returncode == 1                 # first attempt failed: the job fails
    path.write_text(path.read_text().replace("exit=1", "ready=0.1"))
    assert emu.ctl("daemon-reload").returncode == 0
    deadline = time.monotonic() + 20
    while emu.show("a")["ActiveState"] != "active" and time.monotonic() < deadline:
        time.sleep(0.1)
    props = emu.show("a")
    assert props["ActiveState"] == "active" and int(props["NRestarts"]) >= 1


def test_a_reused_session_number_is_not_the_units(monkeypatch):
    """The stop of a unit whose main process exited signals its control group: processes the
    supervisor adopted and their descendants, and its session. A new session that got the old
    main pid's number (pid_max 32768: a long suite wraps it), e.g. the sshd session of the very
    ``systemctl restart`` asking, is not the unit's; it failed a fleet deploy with exit -1."""
    from tests.fleet.emu import proc

    me = proc.os.getpid()
    leftovers = {400: (me, 300), 401: (400, 300)}   # adopted by the supervisor (a subreaper) + its child
    ours = {300: (me, 300), 301: (300, 300), **leftovers}   # the main process alive: its session counts
    monkeypatch.setattr(proc, "_procs", lambda: dict(ours))
    assert proc.cgroup_pids(300) == [300, 301, 400, 401]
    reused = {300: (77, 300), 301: (300, 300), 302: (1, 300), **leftovers}   # someone else's session 300
    monkeypatch.setattr(proc, "_procs", lambda: dict(reused))
    assert proc.cgroup_pids(300) == [400, 401]
