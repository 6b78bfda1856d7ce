"""The supervisor's I/O: service output -> journal, the NOTIFY_SOCKET, and reaping children.

Emulates systemd's stdout/stderr-to-journal stream (one journal record per line, tagged with the
process name and MainPID; a final partial line is flushed at exit) and the sd_notify(3) receiving
side: an AF_UNIX SOCK_DGRAM socket with SO_PASSCRED, so the sender's PID arrives as SCM_CREDENTIALS
and NotifyAccess=main|exec|all can be enforced as in systemd.service(5).
"""

from __future__ import annotations

import os
import select
import socket
import struct

from . import state
from .paths import Paths


class ServiceIO:
    def __init__(self, paths: Paths, unit: dict):
        self.p, self.u, self.name = paths, unit, unit["id"]
        self.stop_requested = self.reset_requested = False
        self.pipe_r, self.pipe_w = os.pipe()
        os.set_blocking(self.pipe_r, False)
        self.buf = b""
        self.exited: dict[int, int] = {}
        self.main_pid = 0
        self.ready = self.was_active = False
        self.ident = os.path.basename(unit["exec_start"][0]["argv"][0]) if unit["exec_start"] else "unknown"
        self.notify_addr = paths.notify_socket(self.name)
        self.sock = None

    # ---- plumbing ----------------------------------------------------------------------------
    def log(self, msg: str, *, unit_prefix: bool = True) -> None:
        state.journal(self.p, self.name, f"{self.name}: {msg}" if unit_prefix else msg)

    def save(self, **kw) -> None:
        self.st.update(kw)
        state.write(self.p, self.name, self.st)

    def set(self, active: str, sub: str, **kw) -> None:
        self.was_active = self.was_active or active == "active"
        if active == "active" and self.st.get("JobResult") is None:
            self.st["JobResult"] = "done"                  # the start job completes
        state.set_state(self.st, active, sub)
        self.save(**kw)

    def open_notify(self) -> None:
        if self.u["notify_access"] == "none":
            return
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        addr = self.notify_addr
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        elif os.path.exists(addr):
            os.unlink(addr)
        self.sock.bind(addr)

    def pump(self, timeout: float = 0.2) -> None:
        """Move service output to the journal, handle notify messages and reset-failed, reap children."""
        if self.reset_requested:
            self.reset_requested = False
            self.save(NRestarts=0, Result="success")
        fds = [self.pipe_r] + ([self.sock] if self.sock else [])
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            readable = []
        if self.pipe_r in readable:
            self.read_output()
        if self.sock in readable:
            self.read_notify()
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            self.exited[pid] = status

    def read_output(self, final: bool = False) -> None:
        try:
            while True:
                chunk = os.read(self.pipe_r, 65536)
                if not chunk:
                    break
                self.buf += chunk
        except BlockingIOError:
            pass
        *lines, self.buf = self.buf.split(b"\n")
        if final and self.buf:
            lines, self.buf = lines + [self.buf], b""
        for line in lines:
            state.journal(self.p, self.name, line.decode(errors="replace").rstrip("\r"),
                          ident=self.ident, pid=self.main_pid or os.getpid())

    def read_notify(self) -> None:
        try:
            data, anc, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(12))
        except OSError:
            return
        pid = 0
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", payload[:12])[0]
        access = self.u["notify_access"]
        if access in ("main", "exec") and pid != self.main_pid:
            self.log(f"Got notification message from PID {pid}, but reception only permitted for "
                     f"main PID {self.main_pid}")
            return
        for line in data.decode(errors="replace").split("\n"):
            key, _, value = line.partition("=")
            if key == "READY" and value == "1":
                self.ready = True
            elif key == "STATUS":
                self.save(StatusText=value)
            elif key == "STOPPING" and value == "1" and self.st["ActiveState"] == "active":
                self.set("deactivating", "stop")

