"""Local TCP port forwarding over an SSH ``direct-tcpip`` channel (RFC 4254 §7.2).

Why readiness and smoke probes go through it: docs/operations.md §7, §13.6.

Fabric's ``Connection.forward_local`` needs a fixed local port chosen in advance (racy) and does
not report it; this binds 127.0.0.1:0, reports the port the kernel chose, and opens one Paramiko
``direct-tcpip`` channel per accepted connection, so httpx can talk to host:port as the node sees
it. A connection the remote side refuses is closed at once (the client sees a disconnect).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable, Iterator

import paramiko


def _pump(sock: socket.socket, chan: paramiko.Channel, stop: threading.Event) -> None:
    with contextlib.closing(sock), contextlib.closing(chan):
        while not stop.is_set():
            ready, _, _ = select.select([sock, chan], [], [], 0.5)
            for src, dst in ((sock, chan), (chan, sock)):
                if src in ready:
                    try:
                        data = src.recv(65536)
                        if not data:
                            return
                        dst.sendall(data)
                    except OSError:
                        return


@contextlib.contextmanager
def forward_local(get_transport: Callable[[], paramiko.Transport], host: str, port: int,
                  bind: str = "127.0.0.1", open_timeout: float = 10.0) -> Iterator[tuple[str, int]]:
    """Yield ``(bind, local_port)``; connections to it reach ``host:port`` from the SSH server.

    get_transport returns the (live) Paramiko transport for each new connection. It is called once
    before anything is yielded, so a node that cannot be reached raises here, in the caller's
    thread (UnreachableError, exit 3), instead of in the acceptor thread while the client waits.
    A later failure to reach the node closes that one connection (the client sees a disconnect);
    opening each tunnel channel waits at most ``open_timeout`` s (a silent node: the HTTP client
    sees a disconnect instead of waiting for its own read timeout).
    On exit the listener and all tunnelled connections are closed."""
    get_transport()  # connect now: errors propagate to the caller
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((bind, 0))
    listener.listen(32)
    listener.settimeout(0.2)
    stop = threading.Event()
    workers: list[threading.Thread] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                sock, peer = listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                chan = get_transport().open_channel("direct-tcpip", (host, port), peer,
                                                   timeout=open_timeout)
            except Exception:  # noqa: BLE001 - unreachable node, refused channel: drop this connection
                sock.close()
                continue
            worker = threading.Thread(target=_pump, args=(sock, chan, stop), daemon=True)
            worker.start()
            workers.append(worker)

    acceptor = threading.Thread(target=serve, name=f"forward-{host}:{port}", daemon=True)
    acceptor.start()
    try:
        yield listener.getsockname()[:2]
    finally:
        stop.set()
        acceptor.join(2)
        listener.close()
        for worker in workers:
            worker.join(2)
