"""Is the container where the inventory says it is, and running? And: was a failure pct's own?

`pct exec VMID -- argv` fails BEFORE running argv when the container is stopped, is not on this
node, or pct itself is missing; its message then is pct's, never the command's (pve-container
src/PVE/CLI/pct.pm, pve-guest-common AbstractConfig.pm; a Perl `die` exits 255):

    container '200' not running!                                   stopped (exec/enter)
    Configuration file 'nodes/pve1/lxc/200.conf' does not exist    no such CT on this node
    can only push files to a running CT                            stopped (push)
    bash: line 1: pct: command not found                           (exit 127) not a PVE node

`check(transport)` reads the node's `pct list` (VMID and Status are its first two columns; the
Lock column may be blank, docs/operations.md §13.4) once for all containers of that node asked
within LIST_TTL_S (one `pct` run per node in a `status --all`, not one per container), and asks
`pct status VMID` (prints `status: running` or `status: stopped`, exit 0) for a container the
list does not show as running or stopped (pct's own message then says why: absent, no pct); `pct_failure(result)` recognises the messages above in a failed
`pct exec` result, so that such a failure is reported as what it is (container stopped, missing,
no pct) and never as a failure of the command ddtctl wanted to run (e.g. a GPU error).
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from dataclasses import dataclass

LIST_TTL_S = 10.0          # a node's `pct list` answers the containers asked within this many seconds
_lists: "weakref.WeakKeyDictionary[object, tuple[float, dict[int, str] | None]]" = weakref.WeakKeyDictionary()
_list_locks: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()
_guard = threading.Lock()

# (pattern over one stderr line, state, explanation template)
_PCT_DIES = (
    (re.compile(r"^container '(?P<vmid>\d+)' not running!$"), "stopped", "container stopped"),
    (re.compile(r"^CT (?P<vmid>\d+) not running$"), "stopped", "container stopped"),
    (re.compile(r"^can only (push files to a running CT|pull files from a running VM)"), "stopped",
     "container stopped"),
    (re.compile(r"^Configuration file '(?P<conf>nodes/(?P<node>[^/']+)/lxc/(?P<vmid>\d+)\.conf)' does not exist$"),
     "absent", "container {vmid} does not exist on node {node} (wrong vmid, or it lives on another node)"),
)
_NO_PCT = re.compile(r"\bpct: (command )?not found\b|\bpct: No such file or directory\b")


@dataclass(frozen=True)
class ContainerState:
    """Where a container host stands. state: running | stopped | absent | no-pct | error | n/a
    (n/a: not a container host). detail: a one-line explanation (empty when running)."""

    state: str
    detail: str = ""

    @property
    def running(self) -> bool:
        return self.state in ("running", "n/a")

    def to_dict(self) -> dict:
        return {"state": self.state, "detail": self.detail}


def pct_failure(exit_code: int, stderr: str) -> ContainerState | None:
    """The container problem behind a failed `pct ...` call, or None when the failure was not
    pct's own (the command inside ran and failed by itself)."""
    if exit_code == 0:
        return None
    if exit_code == 127 and _NO_PCT.search(stderr):
        return ContainerState("no-pct", "pct not found on the node (not a Proxmox VE node?)")
    if exit_code != 255:
        return None
    for line in stderr.splitlines():
        line = line.strip()
        for pattern, state, template in _PCT_DIES:
            match = pattern.match(line)
            if match:
                return ContainerState(state, template.format(**match.groupdict()))
    return None


def parse_list(text: str) -> dict[int, str]:
    """vmid -> status from `pct list` output (header and malformed lines skipped; pure)."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0].isdigit():
            out[int(words[0])] = words[1]
    return out


def node_listing(node) -> dict[int, str] | None:
    """The node's `pct list` (vmid -> status), shared by the callers within LIST_TTL_S; None when it
    failed (the caller then asks `pct status`). Raises what the node transport raises."""
    with _guard:
        lock = _list_locks.setdefault(node, threading.Lock())
    with lock:
        cached = _lists.get(node)
        if cached is not None and time.monotonic() - cached[0] < LIST_TTL_S:
            return cached[1]
        res = node.run(["pct", "list"], timeout=60)
        listing = parse_list(res.text) if res.ok else None
        _lists[node] = (time.monotonic(), listing)
        return listing


def check(transport) -> ContainerState:
    """The container's state from its node's `pct list`, else `pct status VMID`;
    ContainerState("n/a") for other transports.

    Raises what the node transport raises (UnreachableError when the node cannot be reached)."""
    node, vmid = getattr(transport, "node", None), getattr(transport, "vmid", None)
    if node is None or vmid is None:
        return ContainerState("n/a")
    listed = (node_listing(node) or {}).get(int(vmid))
    if listed == "running":
        return ContainerState("running")
    if listed == "stopped":
        return ContainerState("stopped", "container stopped")
    res = node.run(["pct", "status", str(int(vmid))], timeout=60)
    why = pct_failure(res.exit_code, res.err_text)
    if why is not None:
        return why
    words = res.text.split()
    if res.ok and words[:1] == ["status:"] and len(words) > 1:
        state = words[1]
        if state == "running":
            return ContainerState("running")
        if state == "stopped":
            return ContainerState("stopped", "container stopped")
        return ContainerState("error", f"pct status says {state!r}")
    tail = (res.err_text or res.text).strip().splitlines()
    return ContainerState("error", f"pct status {vmid} failed (exit {res.exit_code})"
                          + (f": {tail[-1]}" if tail else ""))
