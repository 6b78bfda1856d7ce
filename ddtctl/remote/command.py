"""Pure argv builders and the one serialiser per shell layer (no I/O here).

Quoting model (docs/operations.md §2, §13.1): a remote command is an argv list everywhere. It is
serialised exactly once per shell that parses it:

* SSH: the remote login shell parses the exec string -> :func:`shell_join` (``shlex.join``), done
  only by the SSH transport, never by callers;
* ``pct exec`` / ``lxc-attach`` add no shell: argv passes through untouched (:func:`pct_exec`);
* ``bash -lc``: only with a fixed script that takes its values as positional parameters
  (:func:`bash_script`), so values are never parsed as code.

Nothing here joins argv with spaces, and every builder refuses a plain string where an argv is
expected, so the field failures of docs/operations.md §13.1 items 1-3 (missing ``--``, re-split
values, ``unexpected EOF while looking for matching``) cannot be produced.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

from ddtctl.errors import ArgvError

#: PATH that LXC sets for a clear-env attach (lxc attach.c), used for every ``pct exec``.
LXC_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Environment every ``pct exec`` starts from (docs/operations.md §13.2, "Environment").
BASE_ENV: tuple[tuple[str, str], ...] = (
    ("HOME", "/root"),
    ("LANG", "C.UTF-8"),
    ("LC_ALL", "C.UTF-8"),
    ("PATH", LXC_DEFAULT_PATH),
)

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_PERMS = re.compile(r"(0x[0-9a-fA-F]+|[0-7]+)\Z")
MASK = "***"


def validate_argv(argv: Sequence[str], what: str = "argv") -> tuple[str, ...]:
    """Return argv as a tuple after checking it can be passed as a real argv vector.

    Raises ArgvError for: a plain ``str``/``bytes`` (would be split or iterated per character),
    an empty argv, a non-``str`` element, or an element containing a NUL byte (execve(2) ends an
    argument at NUL, so it could never arrive intact)."""
    if isinstance(argv, (str, bytes, bytearray)):
        raise ArgvError(f"{what} must be a list of strings, not a single string: {argv!r}")
    items = tuple(argv)
    if not items:
        raise ArgvError(f"{what} is empty (pct would fail with 'missing command')")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ArgvError(f"{what}[{i}] is {type(item).__name__}, not str: {item!r}")
        if "\x00" in item:
            raise ArgvError(f"{what}[{i}] contains a NUL byte, which no argv can carry: {item!r}")
    return items


def shell_join(argv: Sequence[str]) -> str:
    """Serialise argv for ONE POSIX shell (bash/dash/sh) with ``shlex.join``.

    The only serialiser in ddtctl; used once per shell layer (the SSH exec string). Raises
    ArgvError as :func:`validate_argv` (notably for NUL bytes)."""
    return shlex.join(validate_argv(argv))


def _assignments(env: Mapping[str, str] | None) -> list[str]:
    out = []
    for key, value in (env or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ArgvError(f"invalid environment variable name: {key!r}")
        if not isinstance(value, str) or "\x00" in value:
            raise ArgvError(f"environment value of {key} must be a str without NUL bytes")
        out.append(f"{key}={value}")
    return out


def _plain_program(argv: tuple[str, ...]) -> None:
    # env(1) would take "A=B" as another assignment and "-x" as its own option.
    if "=" in argv[0] or argv[0].startswith("-"):
        raise ArgvError(f"program name {argv[0]!r} cannot follow env(1); use an absolute path")


def with_env(argv: Sequence[str], env: Mapping[str, str] | None) -> list[str]:
    """argv prefixed with ``/usr/bin/env K=V ...`` when env is non-empty, else argv unchanged.

    Values travel as argv elements (never as shell text). Raises ArgvError for invalid names,
    values with NUL, or a program name containing ``=`` or starting with ``-``."""
    items = validate_argv(argv)
    if not env:
        return list(items)
    _plain_program(items)
    return ["/usr/bin/env", *_assignments(env), *items]


def _vmid(vmid: int | str) -> str:
    text = str(vmid)
    if not text.isdigit() or not 100 <= int(text) <= 999_999_999:
        raise ArgvError(f"vmid must be an integer 100..999999999, got {vmid!r}")
    return str(int(text))


def pct_exec(
    vmid: int | str,
    argv: Sequence[str],
    keep_env: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """``pct exec <vmid> --keep-env 0 -- /usr/bin/env -i HOME=/root LANG=C.UTF-8 LC_ALL=C.UTF-8
    PATH=<LXC default> [K=V ...] <argv...>`` (pct(1); docs/operations.md §13.2, §13.1 item 1).

    ``--`` is always present, so words of argv that start with ``-`` never reach pct's Getopt.
    keep_env=True emits ``--keep-env 1`` and no ``env -i`` (the CT then sees pct's environment with
    PATH=/sbin:/bin:/usr/sbin:/usr/bin); env, if given, is still applied with ``/usr/bin/env K=V``.
    Later assignments win, so ``env={"PATH": ...}`` overrides the default PATH.

    Raises ArgvError for an empty argv ("missing command"), a bad vmid, NUL bytes or bad names."""
    items = validate_argv(argv)
    head = ["pct", "exec", _vmid(vmid)]
    if keep_env:
        return [*head, "--keep-env", "1", "--", *with_env(items, env)]
    _plain_program(items)
    base = [f"{k}={v}" for k, v in BASE_ENV]
    return [*head, "--keep-env", "0", "--", "/usr/bin/env", "-i", *base, *_assignments(env), *items]


def pct_push(
    vmid: int | str,
    src: str,
    dest: str,
    perms: int | str | None = None,
    user: str | int | None = None,
    group: str | int | None = None,
) -> list[str]:
    """``pct push <vmid> <src> <dest> [--perms <octal>] [--user <u>] [--group <g>]``.

    Semantics: pct(1) ``push``; docs/operations.md §13.3.

    src is a path on the node, dest a FULL FILE path inside the CT; both must be absolute (so they
    can never be read as options by pct's permuting Getopt) and dest must not end with ``/``.
    perms: an int (``0o644`` -> ``"644"``, pct reads octal) or an octal/``0x`` string. user/group
    are resolved inside the CT by pct. The parent directory must already exist (pct does not create
    it) and pct can exit 0 after a failed copy: callers must verify (see remote/pct.py).

    Raises ArgvError for relative paths, a trailing ``/``, NUL bytes or malformed perms."""
    for label, path in (("src", src), ("dest", dest)):
        validate_argv([path], label)
        if not path.startswith("/"):
            raise ArgvError(f"pct push {label} must be an absolute path, got {path!r}")
    if dest.endswith("/"):
        raise ArgvError(f"pct push needs a full file path as destination, got directory {dest!r}")
    argv = ["pct", "push", _vmid(vmid), src, dest]
    if perms is not None:
        text = format(perms, "o") if isinstance(perms, int) else str(perms)
        if not _PERMS.match(text):
            raise ArgvError(f"perms must be octal digits or 0x-hex, got {perms!r}")
        argv += ["--perms", text]
    for flag, value in (("--user", user), ("--group", group)):
        if value is not None:
            validate_argv([str(value)], flag)
            argv += [flag, str(value)]
    return argv


def timeout_argv(argv: Sequence[str], seconds: float, kill_after: float = 5.0) -> list[str]:
    """``timeout -k <kill_after> -- <seconds> argv...`` (GNU coreutils timeout(1)): SIGTERM after
    ``seconds``, SIGKILL ``kill_after`` s later; exit 124 on timeout (137 when it had to be killed).

    Raises ArgvError as :func:`validate_argv`, or for a duration that is not positive."""
    items = validate_argv(argv)
    if not seconds > 0:
        raise ArgvError(f"timeout must be positive, got {seconds!r}")
    return ["timeout", "-k", f"{kill_after:g}", "--", f"{seconds:g}", *items]


def bash_script(script: str, *args: str) -> list[str]:
    """``bash -lc <script> ddtctl <args...>``: the script is ONE argv element and the values reach it
    only as positional parameters ``"$1"``, ``"$2"``, ... (``$0`` is ``ddtctl``), never as code.

    The script must be a constant written in ddtctl's source, never built from values.
    Raises ArgvError for an empty script or NUL bytes."""
    if not isinstance(script, str) or not script.strip():
        raise ArgvError("bash_script needs a non-empty script")
    return list(validate_argv(["bash", "-lc", script, "ddtctl", *args], "bash_script argv"))


def display(argv: Sequence[str], secrets: Iterable[str] = ()) -> str:
    """A shell-quoted one-line rendering of argv for logs and dry-run output, with every occurrence
    of each non-empty secret replaced by ``***`` before quoting (so no secret leaks even partially).
    For display only: never send this string anywhere."""
    hidden = sorted((s for s in secrets if s), key=len, reverse=True)
    masked = []
    for item in validate_argv(argv):
        for secret in hidden:
            item = item.replace(secret, MASK)
        masked.append(item)
    return shlex.join(masked)
