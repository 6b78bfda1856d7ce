"""Pure tests of the emulation's systemd syntax: quoting, escapes, specifiers, `$` expansion, env files,
time spans and unit loading (systemd.syntax(7), systemd.unit(5), systemd.service(5), systemd.exec(5)).
"""

from __future__ import annotations

import pytest

from tests.fleet.emu import unitfile
from tests.fleet.emu.paths import Paths
from tests.fleet.emu.syntax import SyntaxErr, expand_argv, extract_words, resolve_specifiers
from tests.fleet.emu.values import parse_env_file, parse_timespan


@pytest.mark.parametrize("line,words", [
    ('/bin/x "a b" c', ["/bin/x", "a b", "c"]),
    ("'single \"q\"' x", ['single "q"', "x"]),
    ('mid"dle quo"ted', ["middle quoted"]),
    (r'"tab\there" \x41\101 \s', ["tab\there", "AA", " "]),
    (r"'esc\n in single'", ["esc\n in single"]),          # systemd decodes escapes in '' too
    (r"keep\d unknown", [r"keep\d", "unknown"]),
    ('""', [""]),
])
def test_extract_words(line, words):
    assert extract_words(line) == words


def test_unbalanced_quote_is_an_error():
    with pytest.raises(SyntaxErr):
        extract_words('"open')


def test_specifiers():
    spec = {"n": "a.service", "N": "a", "i": ""}
    assert resolve_specifiers("%n %N 100%% %%s", spec) == "a.service a 100% %s"
    with pytest.raises(SyntaxErr, match="Invalid slot"):
        resolve_specifiers("date +%s", spec)


def test_dollar_expansion_in_command_lines():
    env = {"OPTS": "--a 'b c'  --d", "ONE": "x y", "EMPTY": ""}
    argv = ["/p", "$OPTS", "${ONE}", "pre${ONE}post", "$$ONE", "$ONE$ONE", "$UNSET", "$EMPTY",
            "${UNSET:-dflt}", "${ONE:+set}"]
    assert expand_argv(argv, env) == ["/p", "--a", "b c", "--d", "x y", "prex ypost", "$ONE",
                                      "$ONE$ONE", "dflt", "set"]


def test_environment_file_rules():
    text = ("# comment\n; other comment\nA=1\n  B = spaced  \nC=\"q \\\"x\\\" \\$y \\n\"\n"
            "D='multi\nline'\nE=cont\\\ninued\nexport F=1\nnoequals\nG=\n")
    env, warnings = parse_env_file(text)
    assert env == {"A": "1", "B": "spaced", "C": 'q "x" $y \\n', "D": "multi\nline", "E": "continued",
                   "G": ""}
    assert len(warnings) == 2


@pytest.mark.parametrize("text,sec", [("90", 90), ("1.5s", 1.5), ("30min", 1800), ("1h 30min", 5400),
                                      ("100ms", 0.1), ("infinity", float("inf"))])
def test_timespans(text, sec):
    assert parse_timespan(text) == sec


def _load(tmp_path, name, text, dropins=None, filename=None):
    paths = Paths(tmp_path)
    paths.unit_dir.mkdir(parents=True, exist_ok=True)
    (paths.unit_dir / (filename or name)).write_text(text)
    for i, body in enumerate(dropins or []):
        d = paths.unit_dir / f"{name}.d"
        d.mkdir(exist_ok=True)
        (d / f"{i:02d}.conf").write_text(body)
    return unitfile.load(paths, name)


def test_load_continuation_dropins_resets_and_warnings(tmp_path):
    u = _load(tmp_path, "a.service", "[Unit]\nFrobnicate=1\n[Service]\nEnvironment=A=1 B=2\n"
              "ExecStart=/bin/echo \\\n  # comment inside a continuation is skipped\n  one two\n",
              dropins=["[Service]\nEnvironment=\nEnvironment=C=3\nExecStart=\nExecStart=/bin/echo three\n"
                       "Restart=on-failure\nRestartSec=2\nTimeoutSec=0\n"])
    assert u["load_state"] == "loaded" and u["environment"] == {"C": "3"}
    assert [c["argv"] for c in u["exec_start"]] == [["/bin/echo", "three"]]
    assert (u["restart"], u["restart_sec"], u["timeout_start"]) == ("on-failure", 2.0, float("inf"))
    assert any("Unknown key name 'Frobnicate'" in w for w in u["warnings"])


@pytest.mark.parametrize("body,needle", [
    ("[Service]\nType=notify\n", "has no ExecStart="),
    ("[Service]\nExecStart=/bin/a\nExecStart=/bin/b\n", "more than one ExecStart="),
    ("[Service]\nExecStart=/bin/echo %z\n", "Invalid slot"),
])
def test_bad_settings(tmp_path, body, needle):
    u = _load(tmp_path, "b.service", body)
    assert u["load_state"] == "bad-setting" and needle in u["load_error"]


def test_template_instance_and_prefixes(tmp_path):
    u = _load(tmp_path, "srv@ct-200.service",
              "[Service]\nExecStart=-@/bin/sleep sleeper %i %I\nWorkingDirectory=-/missing\n",
              filename="srv@.service")
    cmd = u["exec_start"][0]
    assert (cmd["path"], cmd["argv"], cmd["ignore_failure"]) == ("/bin/sleep", ["sleeper", "ct-200", "ct/200"],
                                                                 True)
    assert u["working_directory"] == ["/missing", True]
