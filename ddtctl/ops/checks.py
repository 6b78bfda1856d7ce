"""What a smoke check raises: a real exception, not `assert`, so the checks fail under `python -O`
too (ops/smoke.py, ops/smoke_tools.py)."""

from __future__ import annotations


class CheckFailed(Exception):
    """A smoke check found the service wrong (the message says how)."""


def expect(condition: object, message: str) -> None:
    """Raise CheckFailed(message) unless `condition` holds."""
    if not condition:
        raise CheckFailed(message)
