"""systemd notification protocol (sd_notify) for `Type=notify` units.

`notify("READY=1")` once the model is loaded and warmed up, `notify("STATUS=...")` while loading,
`notify("STOPPING=1")` when draining. Without `$NOTIFY_SOCKET` (not started by systemd) every call
is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ddtree_server.sdnotify")


def notify(*lines: str) -> bool:
    """Send `KEY=VALUE` lines to `$NOTIFY_SOCKET` as one datagram.

    Returns True when sent, False without a socket or on a send error (logged, never raised):
    a broken notification channel must not take the server down.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not lines:
        return False
    if address.startswith("@"):          # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
        return True
    except OSError as exc:
        log.warning("sd_notify to %s failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False


def on_state(state: str, detail: str) -> None:
    """Worker state observer: STATUS for every state, READY=1 on ready, STOPPING=1 on draining."""
    status = f"STATUS={state}: {detail}".replace("\n", " ")[:200]
    if state == "ready":
        notify("READY=1", status)
    elif state == "draining":
        notify("STOPPING=1", status)
    else:
        notify(status)
