"""Results of remote commands and file pushes (pure data, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from ddtctl.errors import RemoteError

# Output of a command string that was quoted for the wrong number of shell layers
# (docs/operations.md §13.1, item 3). ddtctl never builds such strings; seeing it means a bug in
# ddtctl, never the user's fault.
_QUOTING_BUG_MARKERS = (b"unexpected EOF while looking for matching", b"syntax error: unterminated")


@dataclass(frozen=True)
class Result:
    """Outcome of one command.

    argv: the argv that was run (as given to the transport, before serialisation).
    exit_code: the command's exit status; 128+N when killed by signal N inside a container
        (lxc-attach convention); -1 when the SSH server reported no status (killed at the SSH layer).
    stdout, stderr: raw bytes, never decoded lossily here.
    seconds: wall time of the command as seen by the client, seconds.
    transport: ``Transport.name`` that ran it (for messages).
    """

    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes
    seconds: float
    transport: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")

    @property
    def err_text(self) -> str:
        """stderr decoded as UTF-8 (undecodable bytes replaced)."""
        return self.stderr.decode("utf-8", "replace")

    @property
    def quoting_bug(self) -> bool:
        """True when stderr has the shape of a shell quoting bug (docs/operations.md §13.1 item 3)."""
        return any(m in self.stderr for m in _QUOTING_BUG_MARKERS)

    def check(self) -> Result:
        """Return self if ``exit_code == 0``.

        Raises RemoteError naming the transport, the command, the exit code and the last lines of
        stderr; the message says "quoting bug in ddtctl" for the symptom of docs/operations.md
        §13.1 item 3."""
        if self.ok:
            return self
        from ddtctl.remote.command import shell_join  # local import: command imports nothing of ours

        tail = "\n".join(self.err_text.strip().splitlines()[-10:])
        where = f"{self.transport}: " if self.transport else ""
        msg = f"{where}command failed with exit code {self.exit_code}: {shell_join(self.argv)}"
        if tail:
            msg += f"\n{tail}"
        if self.quoting_bug:
            msg += "\n(this stderr is the signature of a quoting bug in ddtctl; please report it)"
        raise RemoteError(msg, self)


@dataclass(frozen=True)
class PutResult:
    """Outcome of ``Transport.put``.

    bytes_sent: bytes written by this call over all its attempts (0 when skipped; from the verified
        partial file on when resumed), bytes.
    sha256: hex digest of the file, verified on the destination.
    skipped: True when the destination already had exactly this content.
    """

    bytes_sent: int
    sha256: str
    skipped: bool
