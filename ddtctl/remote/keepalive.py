"""Notice a silent SSH peer: OpenSSH's ServerAliveInterval / ServerAliveCountMax for Paramiko.

Paramiko's own ``Transport.set_keepalive`` sends requests that want no reply, so a peer whose
TCP connection stays open while nothing answers (a frozen sshd, a hung node) is never noticed and
every read waits for ever. :class:`Keepalive` instead keeps one ``keepalive@openssh.com`` global
request WITH want-reply in flight every ``interval`` seconds (sshd answers it with
SSH_MSG_REQUEST_FAILURE, which counts as an answer, as in ssh(1)). When no answer has arrived for
``interval * count`` seconds it records "no answer in N s" and closes the transport: every
channel, SFTP read and ``open_channel`` waiting on it then fails at once.
"""

from __future__ import annotations

import threading
import time

import paramiko

KEEPALIVE_REQUEST = "keepalive@openssh.com"


class Keepalive:
    """Watch ``transport``; ``reason`` is set (and the transport closed) when it fell silent.

    interval: seconds between requests (> 0); count: answers that may be missing in a row."""

    def __init__(self, transport: paramiko.Transport, interval: float, count: int, name: str = ""):
        self.transport, self.interval, self.count = transport, float(interval), max(1, int(count))
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"keepalive {name}", daemon=True)
        self._thread.start()

    @property
    def limit(self) -> float:
        """Seconds of silence after which the peer is declared gone."""
        return self.interval * self.count

    def stop(self) -> None:
        self._stop.set()

    def _ask(self, answered: threading.Event) -> None:
        try:
            self.transport.global_request(KEEPALIVE_REQUEST, wait=True)
        except Exception:  # noqa: BLE001 - a dying transport: the watcher notices it is inactive
            return
        if self.transport.is_active():
            answered.set()

    def _watch(self) -> None:
        tick = min(1.0, self.interval / 4)
        last_answer = sent = time.monotonic()
        pending: threading.Event | None = None
        while not self._stop.wait(tick):
            if not self.transport.is_active():
                return
            now = time.monotonic()
            if pending is not None and pending.is_set():
                last_answer, pending = now, None
            if pending is None and now - last_answer >= self.interval:
                pending, sent = threading.Event(), now
                threading.Thread(target=self._ask, args=(pending,), daemon=True).start()
            elif pending is not None and now - last_answer >= self.limit and now - sent >= tick:
                self.reason = f"no answer in {self.limit:g} s"
                try:
                    self.transport.close()
                except Exception:  # noqa: BLE001 - closing a dead transport must not raise
                    pass
                return
