"""Exception hierarchy of ddtctl and the process exit codes it maps to.

Every error ddtctl raises on purpose derives from :class:`DdtctlError`; its ``exit_code`` is what
the CLI exits with (the table, and why ddtctl publishes its own: docs/operations.md §10):

====  =========================================================  ==============================
code  meaning                                                    raised as
====  =========================================================  ==============================
0     everything ok                                              (no exception)
1     at least one host failed (a command ran and failed, a      RemoteError, CommandTimeout,
      push could not be verified)                                TransferError
2     usage, inventory or argv error (nothing was attempted)     UsageError, InventoryError,
                                                                 ArgvError
3     a host was unreachable: connect/auth/host-key failure,     UnreachableError, HostKeyError,
      or its API refused the API key (HTTP 401/403)              AuthError
4     readiness deadline passed                                  ReadinessTimeout
5     smoke test failed                                          SmokeFailed
130   interrupted by Ctrl-C (hosts stopped at a step boundary)   cancel.Interrupted
====  =========================================================  ==============================

When several hosts fail differently, the CLI exits with the highest code seen.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    OK = 0
    HOST_FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    READINESS_TIMEOUT = 4
    SMOKE_FAILED = 5
    INTERRUPTED = 130


class DdtctlError(Exception):
    """Base class; ``exit_code`` is the process exit status the CLI uses for it."""

    exit_code: ExitCode = ExitCode.HOST_FAILED


class UsageError(DdtctlError):
    """Bad command line, configuration or programming input; nothing was run (exit 2)."""

    exit_code = ExitCode.USAGE


class InventoryError(UsageError):
    """The inventory file is invalid (message names file, line and key) (exit 2)."""


class ArgvError(UsageError, ValueError):
    """An argv cannot be built or serialised safely (NUL byte, empty argv, non-str element)."""


class RemoteError(DdtctlError):
    """A remote command ran and failed; ``result`` (a remote.result.Result; errors.py imports no
    other module) holds argv, exit code and output (exit 1)."""

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result


class CommandTimeout(RemoteError):
    """A remote command did not finish within its timeout; ``result`` holds the partial output.

    The remote process may still be running (no pty means no SIGHUP, docs/operations.md §13.2)."""


class TransferError(RemoteError):
    """A file push failed or its sha256 did not verify on the destination (exit 1)."""


class UnreachableError(DdtctlError):
    """Cannot connect or authenticate to a host (exit 3)."""

    exit_code = ExitCode.UNREACHABLE


class HostKeyError(UnreachableError):
    """The host key is unknown in strict mode, or CHANGED (possible MITM) (exit 3)."""


class AuthError(DdtctlError):
    """The service's API refused ddtctl's credentials: HTTP 401/403, e.g. the operator's API-key
    variable (inventory `api_key_env`) is unset or wrong (exit 3, like a failed SSH login)."""

    exit_code = ExitCode.UNREACHABLE


class ReadinessTimeout(DdtctlError):
    """The service did not become ready before its deadline (exit 4)."""

    exit_code = ExitCode.READINESS_TIMEOUT


class SmokeFailed(DdtctlError):
    """A smoke check against the served API failed (exit 5)."""

    exit_code = ExitCode.SMOKE_FAILED


def exit_code_for(errors: list[BaseException]) -> int:
    """Exit code for a run that ended with ``errors`` (empty list -> 0): the highest one seen;
    exceptions that are not DdtctlError count as 1 (a host failed)."""
    codes = [int(getattr(e, "exit_code", ExitCode.HOST_FAILED)) for e in errors]
    return max(codes, default=int(ExitCode.OK))
