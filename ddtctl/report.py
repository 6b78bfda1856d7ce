"""How results look: rich tables and lines on STDERR, one JSON document on STDOUT (`--json`).

Nothing else in ddtctl prints (output.py carries the lines and the notices of remote/). rich honours NO_COLOR and drops colour/animation when stderr is not
a terminal.

Lines reach the terminal through output.py (broken-pipe safety, ``err_console``, ``info``), which
the transport layer uses too; this module stays above ops/ and remote/ and imports neither.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, Iterator

from rich.markup import escape
from rich.table import Table

from ddtctl.output import err_console, info

STATUS_STYLE = {"ok": "green", "pass": "green", "changed": "yellow", "planned": "cyan", "skipped": "dim",
                "failed": "red", "fail": "red", "n/a": "dim",
                "loading": "yellow", "warming": "yellow", "stopped": "dim", "unreachable": "red",
                "container stopped": "red", "container missing": "red", "no pct": "red",
                "container error": "red", "auth failed": "red", "not installed": "red", "stalled": "red",
                "unhealthy": "red", "no GPU device": "red", "error": "red"}


def host_message(host: str, message: object) -> str:
    """`host: message`, without repeating the host when the message already starts with it
    (`host: ...` or `host@node: ...` from the transport of that host)."""
    text = str(message)
    if text.startswith((f"{host}: ", f"{host}@")):
        return text
    return f"{host}: {text}"


def emit_json(document: Any) -> None:
    """Write one JSON document to stdout."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """A user-facing error (no traceback), each line of `message` kept."""
    err_console().print(f"[red]error:[/red] {escape(message)}")


def _styled(status: str) -> str:
    style = STATUS_STYLE.get(status, "")
    return f"[{style}]{escape(status)}[/{style}]" if style else escape(status)


def step_line(host: str, step: Any) -> None:
    """One deploy step as it finishes: `[host] step  status  detail (s)`."""
    took = f" ({step.seconds:.1f} s)" if step.seconds >= 0.5 else ""
    err_console().print(f"[bold]{escape(host)}[/bold] {escape(step.name):<16} {_styled(step.status):<8} "
                        f"{escape(step.detail)}{took}")


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Callable[[str, int], Callable[[int, int], None]] | None]:
    """Yield a factory `(label, total_bytes) -> callback(done, total)` drawing rich bars on stderr."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn  # deploy only

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=err_console(), transient=True)
    lock = threading.Lock()

    def factory(label: str, total: int) -> Callable[[int, int], None]:
        with lock:
            task = progress.add_task(label, total=total)

        def update(done: int, total_now: int) -> None:
            progress.update(task, completed=done, total=total_now)
        return update

    with progress:
        yield factory


def _release_cell(r: Any) -> str:
    """The release `current` points at when the deploy ended (a dry run: the one it would install);
    after a rollback, also the release that was rolled back."""
    current = getattr(r, "current_release", None)
    if r.dry_run or current is None:
        return r.release or "-"
    if r.rolled_back and r.release and r.release != current:
        return f"{current} ({r.release} rolled back)"
    return current


def deploy_table(results: Iterable[Any]) -> None:
    table = Table(title="deploy", title_justify="left")
    for col in ("host", "result", "changed", "restarted", "release", "weights sent", "serving"):
        table.add_column(col, no_wrap=col in ("host", "result", "release"))
    for r in results:
        result = "planned" if r.dry_run and r.ok else ("ok" if r.ok else "failed")
        rollback_failed = any(s.name == "rollback" and s.status == "failed" for s in r.steps)
        if r.rolled_back:
            result += " (rollback failed)" if rollback_failed else " (rolled back)"
        table.add_row(r.host, _styled(result), str(r.changed).lower(), str(r.restarted).lower(),
                      escape(_release_cell(r)), f"{r.weights_bytes_sent} B",
                      f"{r.url} ({r.model_id})" if r.ok or (r.rolled_back and not rollback_failed) else "-")
    err_console().print(table)
    for r in results:
        if r.ok and not r.dry_run:
            info(f"{r.host}: serving {r.model_id} at {r.url}")
        elif r.error is not None:
            error(host_message(r.host, r.error))
            if getattr(r, "service", ""):
                info(f"{r.host}: service now {r.service} (current release: {r.current_release or '-'})")
            if r.rolled_back and not any(s.name == "rollback" and s.status == "failed" for s in r.steps):
                info(f"{r.host}: rolled back: serving {r.model_id} at {r.url}")


def diffs(results: Iterable[Any]) -> None:
    for r in results:
        for path, diff in r.diffs.items():
            err_console().print(f"[bold]{escape(r.host)}[/bold] {escape(path)}")
            err_console().print(escape(diff.rstrip()) or "(new file)")


def smoke_table(reports: Iterable[Any]) -> None:
    for rep in reports:
        table = Table(title=f"smoke {rep.host}", title_justify="left")
        for col in ("check", "result", "detail", "s"):
            table.add_column(col)
        for c in rep.checks:
            table.add_row(c.name, _styled(c.status), escape(c.detail), f"{c.seconds:.1f}")
        err_console().print(table)


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def ready_word(st: Any) -> str:
    """The `ready` cell's word: HostStatus.verdict (ok, stopped, not installed, loading, warming,
    stalled, unhealthy, no GPU device, error, failed, unreachable, container stopped, container
    missing, no pct, auth failed)."""
    verdict = getattr(st, "verdict", None)
    if verdict:
        return verdict
    if st.ready:
        return "ok"
    if getattr(st, "stopped", False):
        return "stopped"
    state = getattr(st, "ready_state", None)
    return state if state in ("loading", "warming") else "failed"


def _gpu_value(value: Any, unit: str = "") -> str:
    if isinstance(value, str):              # nvidia-smi's own token: [N/A], [Insufficient Permissions], ...
        return value
    return "-" if value is None else f"{value:.0f}{unit}"


def gpu_cell(gpus: list[dict] | None, gpu_error: dict | None) -> str:
    """`0: 1024/143771 MiB 3%`; unavailable values as nvidia-smi printed them, with their meaning
    (the row's ``labels``)."""
    if not gpus:
        return gpu_error["problem"] if gpu_error else "-"
    cells = []
    for g in gpus:
        cell = (f"{g['index']}: {_gpu_value(g['memory_used_mib'])}/{_gpu_value(g['memory_total_mib'])} MiB "
                f"{_gpu_value(g['utilization_pct'], '%')}")
        tokens = dict.fromkeys(v for v in (g["memory_used_mib"], g["memory_total_mib"], g["utilization_pct"])
                               if isinstance(v, str))
        if tokens:  # their few words come with the row (ops/gpu.py: GpuInfo.labels)
            labels = g.get("labels") or {}
            cell += " (" + "; ".join(f"{t}: {labels.get(t, 'unavailable')}" for t in tokens) + ")"
        cells.append(cell)
    return "; ".join(cells)


def status_table(statuses: Iterable[Any]) -> None:
    table = Table(title="status", title_justify="left")
    for col in ("host", "kind", "unit", "restarts", "ready", "models", "gpu", "tau", "tok/s", "release"):
        table.add_column(col, no_wrap=col == "host")
    for st in statuses:
        unit = st.unit or {}
        release = st.release or "-"
        if st.version_mismatch:
            release = f"[yellow]{escape(release)} (checkout: {escape(st.expected_release)})[/yellow]"
        word, cause = ready_word(st), getattr(st, "cause", "")
        ready = _styled(word) + (f": {escape(cause)}" if cause and word != "ok" else "")   # every verdict's cause
        unit_cell = _styled(unit.get("active", "-")) if unit.get("installed", True) else _styled("not installed")
        if unit.get("active") == "failed" and unit.get("result") not in (None, "", "success"):
            unit_cell += f" ({escape(unit['result'])})"
        if unit.get("start_limit_hit") and unit.get("result") != "start-limit-hit":
            unit_cell += ", start limit hit"
        table.add_row(st.host, st.kind, unit_cell, str(unit.get("restarts", "-")),
                      ready, ", ".join(st.models) or "-", escape(gpu_cell(st.gpus, st.gpu_error)),
                      _num(st.acceptance_length), _num(st.tokens_per_second, "{:.1f}"), release)
    err_console().print(table)
    for st in statuses:
        for e in st.errors:
            error(host_message(st.host, e))
        if st.gpu_error:
            info(f"{st.host}: GPU: {st.gpu_error['problem']} - {st.gpu_error['hint']}")
        for g in st.gpus or []:
            for token, text in (g.get("notes") or {}).items():
                info(f"{st.host}: GPU {g['index']}: {token} = {text}")


def releases_table(host: str, rels: Iterable[Any]) -> None:
    table = Table(title=f"releases {host}", title_justify="left")
    for col in ("release", "installed", "link"):
        table.add_column(col)
    import datetime as _dt
    for r in rels:
        link = "current" if r.current else ("previous" if r.previous else "")
        table.add_row(r.version_id, _dt.datetime.fromtimestamp(r.mtime).strftime("%Y-%m-%d %H:%M"), link)
    err_console().print(table)


def inventory_table(inv: Any) -> None:
    table = Table(title=f"inventory {inv.path}", title_justify="left")
    for col in ("host", "kind", "where", "service", "port", "model", "groups"):
        table.add_column(col)
    for h in inv.hosts.values():
        where = f"ct{h.vmid}@{h.node_name} ({h.node.address})" if h.kind == "container" else "this machine"
        groups = [g for g, members in inv.groups.items() if h.name in members]
        table.add_row(h.name, h.kind, where, h.service.kind, str(h.service.port), h.model_id, ", ".join(groups))
    err_console().print(table)
