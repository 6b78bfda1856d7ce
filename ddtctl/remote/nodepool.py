"""One SSH transport per Proxmox node for the length of one ddtctl command.

Every container of a node is reached through that node (`pct exec`, `pct push`, tunnels), so the
containers share one SSH connection: each command is a channel over the node's transport (at most
`SshTransport.max_channels` at once, below OpenSSH's MaxSessions), instead of a connection, a key
exchange and an authentication per container. The transports keep their own rules (ssh_config
evaluation, host keys, deadlines, keepalive, reconnect-once, a dead node failing fast): a node that
stops answering is noticed once and every container on it fails at once. Closed together at the
end of the command (cli/_common.py `node_pool`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class NodePool:
    """Transports by node name, made on first use (thread-safe; one per name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[str, Any] = {}
        self._closed = False

    def get(self, name: str, make: Callable[[], Any]) -> Any:
        """The transport of node `name`, made with `make()` the first time (under the pool's lock:
        `make` only evaluates the configuration; connecting happens lazily, per transport)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("node pool used after its command ended")
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    def __len__(self) -> int:
        return len(self._made)

    def close(self) -> None:
        """Close every transport (errors of a broken connection are ignored)."""
        with self._lock:
            made, self._made, self._closed = list(self._made.values()), {}, True
        for transport in made:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass
