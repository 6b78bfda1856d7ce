"""Property test: any argv (text without NUL) sent through the REAL layers arrives byte-identical.

Layers: Paramiko exec request -> real OpenSSH sshd -> root's login shell (bash -c, parse #1) ->
pct emulation (Getopt) -> nsenter into the container's mount namespace -> ``/usr/bin/env -i`` ->
python3 in the container; and the same with one more shell: ``bash -lc <script> ddtctl <values>``
(values as positional parameters). One SSH connection for all examples. The quoting model and the
field failures it rules out: docs/operations.md §13.1 (items 1-3).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtctl.remote.command import bash_script
from ddtctl.remote.pct import ContainerTransport
from ddtctl.remote.transport import LocalTransport
from tests.fleet.conftest import make_node, pve1, pve1_transport  # noqa: F401 - fixtures

pytestmark = pytest.mark.fleet

VMID = 210
# prints the exact bytes of each argument, so the comparison is byte-for-byte
ECHO = ("import os,sys,json; "
        "sys.stdout.write(json.dumps([os.fsencode(a).hex() for a in sys.argv[1:]]))")
NASTY = ["", " ", "'", '"', "$(id)", "`id`", "${HOME}", "\\", "\n", "%s %%", "-la", "--", "*",
         "é€😀", "a'\"b$(c)`d`", "--keep-env", "-mp0", "x=y", ";&|<>", "\r\t", "!$"]
TEXT = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
               max_size=30)
ARGS = st.lists(st.one_of(st.sampled_from(NASTY), TEXT), min_size=1, max_size=6)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def _hex(args: list[str]) -> list[str]:
    return [a.encode("utf-8").hex() for a in args]


@pytest.fixture(scope="module")
def ct(pve1, pve1_transport):  # noqa: F811
    if not (pve1.state / "lxc" / f"{VMID}.conf").exists():
        pve1.create_container(VMID, "quoting")
    return ContainerTransport(pve1_transport, VMID)


@SETTINGS
@given(args=ARGS)
def test_argv_arrives_identical_in_container(ct, args):
    res = ct.run(["python3", "-c", ECHO, *args]).check()
    assert json.loads(res.stdout) == _hex(args)
    assert res.stderr == b""


@SETTINGS
@given(args=ARGS)
def test_positional_parameters_through_bash_lc(ct, args):
    script = f"exec python3 -c {json.dumps(ECHO)} \"$@\""
    res = ct.run(bash_script(script, *args)).check()
    assert json.loads(res.stdout) == _hex(args)


@SETTINGS
@given(args=ARGS)
def test_argv_arrives_identical_on_node(pve1_transport, args):
    res = pve1_transport.run(["python3", "-c", ECHO, *args]).check()
    assert json.loads(res.stdout) == _hex(args)


# A readiness-style probe with nested single and double quotes, $(...), %{...} and a pipe; its
# values (URL, pattern) are positional parameters. Quoted for one layer too few, this exact shape
# produced "bash: -c: line 1: unexpected EOF while looking for matching" in the field
# (docs/operations.md §13.1 item 3).
READY_SCRIPT = """\
url="$1"; want="$2"
code=$(printf '%s' "HTTP/1.1 200 OK for $url" | grep -c "$want") || code=0
[ "$code" -gt 0 ] || { echo "server isn't ready yet" >&2; exit 3; }
printf '%s\\n' "state='ready' code=${code} fmt=%{http_code} url=\\"$url\\""
"""


def test_readiness_script_with_nested_quotes_never_hits_unexpected_eof(ct):
    url, want = "http://127.0.0.1:8000/ready?x='1'&y=\"2\"", "200 OK"
    res = ct.run(bash_script(READY_SCRIPT, url, want))
    assert b"unexpected EOF" not in res.stderr and not res.quoting_bug
    res.check()
    assert res.text == f"state='ready' code=1 fmt=%{{http_code}} url=\"{url}\"\n"


def test_the_field_failure_is_real_and_recognised():
    """The naive form (script glued into a shell string with hand-written quotes) does fail with
    the field error on real bash, and Result flags it as a ddtctl quoting bug."""
    naive = "bash -c '" + READY_SCRIPT + "' ddtctl http://x 200"
    res = LocalTransport().run(["bash", "-c", naive])
    assert res.exit_code != 0 and res.quoting_bug
    assert b"unexpected EOF while looking for matching" in res.stderr


def test_readiness_script_failure_branch_keeps_its_apostrophe(ct):
    res = ct.run(bash_script(READY_SCRIPT, "http://127.0.0.1:1/", "no such text"))
    assert res.exit_code == 3 and res.stderr == b"server isn't ready yet\n"
