"""The error every drafter config rule raises (drafter/config.py, drafter/attention.py)."""

from __future__ import annotations


class DrafterConfigError(ValueError):
    """A drafter config.json is unusable; the message names the file and the key."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: key '{key}': {problem}")
        self.source, self.key, self.problem = source, key, problem
