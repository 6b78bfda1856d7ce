"""The start rate limit of a unit, as systemd 252 keeps it (systemd.unit(5) StartLimitIntervalSec=,
StartLimitBurst=; src/core/unit.c unit_test_start_limit(), src/basic/ratelimit.c ratelimit_below()).

systemd 252's model, reproduced here:
* a FIXED window, not a sliding one: it opens at the first start (begin = now, num = 0) and is
  reopened by the first start more than StartLimitIntervalSec= after `begin`; inside the window,
  starts pass while num < StartLimitBurst=. Every start request counts (num += 1), manual starts
  and Restart= restarts alike, refused ones included;
* the check runs when a start job begins (service_can_start()), so `systemctl start` of an active
  unit, which does nothing, does not count; `restart` counts once (its stop part does not);
* 0 for either setting disables the limit; the defaults are DefaultStartLimitIntervalSec=10s and
  DefaultStartLimitBurst=5 (systemd-system.conf(5)), applied by the unit file loader;
* `systemctl reset-failed` resets it (unit_reset_failed() -> ratelimit_reset());
* `systemctl daemon-reload` resets it too: systemd 252 re-creates every unit on reload and does
  not serialise the start rate limit (systemd 255 added that; 252 ships with Debian 12).
Not emulated: units unloaded by garbage collection losing their counter (an enabled unit is
always referenced).

PID 1 keeps this in memory; here it is one small JSON file per unit (`{"begin": <CLOCK_MONOTONIC
seconds>, "num": N}`) updated under its own flock, because both `systemctl` (manual starts, under
the unit lock) and the unit's supervisor (automatic restarts, without it) take starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time

from .paths import Paths


@contextlib.contextmanager
def _locked(paths: Paths, unit: str):
    paths.ensure()
    with open(paths.ratelimit_file(unit).with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(paths: Paths, unit: str) -> dict:
    try:
        data = json.loads(paths.ratelimit_file(unit).read_text())
        return {"begin": float(data["begin"]), "num": int(data["num"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {"begin": 0.0, "num": 0}


def _write(paths: Paths, unit: str, rl: dict) -> None:
    target = paths.ratelimit_file(unit)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rl))
    os.replace(tmp, target)


def start_allowed(paths: Paths, unit: dict, now: float | None = None) -> bool:
    """Count one start of `unit` (a loaded-unit dict); False when the start limit refuses it."""
    interval, burst = unit["start_limit_interval"], unit["start_limit_burst"]
    if not interval or not burst:
        return True
    now = time.monotonic() if now is None else now
    with _locked(paths, unit["id"]):
        rl = _read(paths, unit["id"])
        if rl["begin"] <= 0 or now - rl["begin"] > interval:
            rl = {"begin": now, "num": 0}
        allowed = rl["num"] < burst
        rl["num"] += 1
        _write(paths, unit["id"], rl)
    return allowed


def reset(paths: Paths, name: str) -> None:
    """Forget the window (reset-failed, daemon-reload)."""
    with _locked(paths, name):
        _write(paths, name, {"begin": 0.0, "num": 0})


def snapshot(paths: Paths, name: str) -> dict:
    """The stored window, for tests: {"begin": s, "num": n}."""
    return _read(paths, name)
