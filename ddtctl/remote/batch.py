"""Several read-only commands in ONE remote command: one `pct exec` per container instead of one each.

On a Proxmox node every `pct exec` starts pct (a Perl program) and lxc-attach, which costs far
more than the command itself; `status` asks each container for its unit state, its GPUs and its
release. `run_batch(transport, argvs)` runs them as

    sh -c SCRIPT ddtctl BOUNDARY N1 ARGV1... N2 ARGV2...

where SCRIPT is the constant below: it takes each argv from the positional parameters (by index,
`"${3}"`; a value is never pasted into code, docs/operations.md §2), runs it through `env --`
(so a missing program fails as it does unbatched: env's message, exit 127) with stdin from
/dev/null, stdout and stderr into temporary files, and prints `BOUNDARY EXIT OUTLEN ERRLEN`
followed by exactly those bytes. Output is read back by length, so any bytes pass.
`Prefetched(transport, results)` then answers `run(argv)` from the batch once per argv (anything
else goes to the real transport), so callers stay unchanged. When the batch itself fails (the
container is stopped, `sh` is missing, the output does not parse) `run_batch` returns None and
each command runs on its own as before, with pct's own messages.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from ddtctl.errors import CommandTimeout
from ddtctl.remote.result import Result

SCRIPT = r'''b=$1; shift
while [ $# -gt 0 ]; do
  n=$1; shift; i=1; cmd=
  while [ "$i" -le "$n" ]; do cmd="$cmd \"\${$i}\""; i=$((i + 1)); done
  cmd="env --$cmd"
  o=$(mktemp) || exit 97
  e=$(mktemp) || exit 97
  eval "$cmd" <"/dev/null" >"$o" 2>"$e"; rc=$?
  printf '%s %s %s %s\n' "$b" "$rc" "$(wc -c <"$o")" "$(wc -c <"$e")"
  cat "$o" "$e"; rm -f "$o" "$e"
  shift "$n"
done
'''


def batch_argv(argvs: Sequence[Sequence[str]], boundary: str) -> list[str]:
    """`sh -c SCRIPT ddtctl BOUNDARY N1 ARGV1... N2 ARGV2...` (pure)."""
    words = ["sh", "-c", SCRIPT, "ddtctl", boundary]
    for argv in argvs:
        words += [str(len(argv)), *argv]
    return words


def parse_batch(out: bytes, boundary: str, argvs: Sequence[Sequence[str]], seconds: float,
                name: str) -> list[Result] | None:
    """The Results of `batch_argv`'s output, or None when it does not have one record per argv."""
    results, pos, mark = [], 0, boundary.encode()
    for argv in argvs:
        end = out.find(b"\n", pos)
        head = out[pos:end].split() if end >= 0 else []
        if len(head) != 4 or head[0] != mark or not all(w.isdigit() for w in head[1:]):
            return None
        code, n_out, n_err = (int(w) for w in head[1:])
        body_out = out[end + 1:end + 1 + n_out]
        body_err = out[end + 1 + n_out:end + 1 + n_out + n_err]
        if len(body_out) != n_out or len(body_err) != n_err:
            return None
        results.append(Result(tuple(argv), code, body_out, body_err, seconds, name))
        pos = end + 1 + n_out + n_err
    return results if pos == len(out) else None


def run_batch(transport, argvs: Sequence[Sequence[str]], *, timeout: float = 60) -> list[Result] | None:
    """Run read-only `argvs` in one remote command (see the module docstring); None when the batch
    could not run or parse (run them one by one then). Raises what transport.run raises, except a
    timeout (None: the caller's own runs have their own deadlines)."""
    if not argvs:
        return []
    boundary = f"ddtctl-{uuid.uuid4().hex}"
    try:
        res = transport.run(batch_argv(argvs, boundary), timeout=timeout)
    except CommandTimeout:
        return None
    if not res.ok:
        return None
    return parse_batch(res.stdout, boundary, argvs, res.seconds, getattr(transport, "name", ""))


class Prefetched:
    """A transport whose `run(argv)` answers from prefetched Results (each once), else delegates."""

    def __init__(self, transport, results: Sequence[Result] | None):
        self._transport = transport
        self._ready: dict[tuple[str, ...], Result] = {r.argv: r for r in results or ()}

    def run(self, argv, **kwargs) -> Result:
        hit = self._ready.pop(tuple(argv), None)
        return hit if hit is not None else self._transport.run(argv, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
