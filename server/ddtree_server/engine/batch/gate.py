"""The speculation gate: does this round draft and verify, or decode plainly? (pure bookkeeping)

Speculation pays while the target's forward over a round's extra rows (chains, trees) is nearly
free and the drafter's guesses are accepted. At a high batch the round's rows pass the GEMM
ridge, and the host work of drafting, building trees and committing grows with every request; with
a poor drafter (or text it cannot predict) few draft tokens are accepted at all. Then a
speculative round gains fewer tokens per second than a plain one, and a busy server would run
slower than batched plain decoding.

The gate measures instead of modelling: for each batch-size bucket it keeps the tokens per second
of recent speculative rounds and of recent plain rounds (wall clock of the round and its
streaming: GPU forwards, host tree build, commit, stop checks, all that a user waits for), and
runs the faster. The slower arm is tried again every ``interval`` rounds of the bucket (``MIN``
.. ``MAX``: doubled each time a try confirms the winner, back to ``MIN`` when the winner changes;
a try faster than the winner also drops the arm's older rounds), so a change of acceptance or
load is followed at a cost of at most one slow round in ``interval``.
An arm's speed is its last ``WINDOW`` rounds' tokens over their seconds (a ratio of sums: the
tokens a speculative round gains are heavy-tailed, so a median of per-round speeds would
undervalue it); a round ``OUTLIER`` times slower than the arm's median round (a CUDA graph
capture) is not counted, and the first ``WARMUP`` rounds of each arm are spent before it is
trusted. Two rules keep the tries cheap where a speculative round costs several plain ones (a
high batch): a try of the slower arm comes at most once per ``(its round time / the winner's - 1)
/ TRY_COST`` rounds (so tries cost at most about ``TRY_COST`` of the throughput), and a bucket met
for the first time above a measured bucket that runs plainly starts plainly too, its speculative
arm measured through tries only (speculation pays less as the batch grows). vLLM's ``speculative_disable_by_batch_size`` is the configured form of the same rule.

Exactness does not depend on the gate: a plain round is a tree of the root alone.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP = 3        # rounds of each arm before its speed is trusted
WINDOW = 16       # rounds in an arm's speed
MIN, MAX = 8, 256  # rounds between tries of the slower arm
OUTLIER = 10.0    # a round this many times slower than the arm's median is not counted (a capture)
TRY_COST = 0.02   # the share of throughput that tries of the slower arm may cost


def bucket_of(batch: int) -> int:
    """The smallest bucket >= batch (the last for larger batches)."""
    return next((b for b in BUCKETS if b >= batch), BUCKETS[-1])


@dataclass
class Arm:
    """Recent rounds of one arm: (tokens, seconds) of each."""

    rounds: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    count: int = 0

    @property
    def ready(self) -> bool:
        return self.count >= WARMUP

    @property
    def round_seconds(self) -> float:
        return sum(r[1] for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def speed(self) -> float:
        """Tokens per second of the window's rounds."""
        return sum(r[0] for r in self.rounds) / sum(r[1] for r in self.rounds) if self.rounds else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        if self.ready and self.rounds and seconds > OUTLIER * statistics.median(r[1] for r in self.rounds):
            return
        self.rounds.append((tokens, seconds))
        self.count += 1


@dataclass
class Bucket:
    """The two arms of one batch-size bucket and the schedule of tries of the slower one."""

    spec: Arm = field(default_factory=Arm)
    plain: Arm = field(default_factory=Arm)
    interval: int = MIN
    since: int = 0
    trying: bool = False
    plain_first: bool = False

    @property
    def winner(self) -> bool:
        """True while speculative rounds are the faster (before both are measured: unless the
        bucket starts plainly)."""
        if not (self.spec.ready and self.plain.ready):
            return not self.plain_first
        return self.spec.speed >= self.plain.speed

    def try_now(self) -> bool:
        """Count a round of the winner; True when the slower arm's try is due."""
        self.since += 1
        self.trying = self.since >= self.interval
        if self.trying:
            self.since = 0
        return self.trying

    def spaced(self) -> None:
        """After a try: the interval is at least what keeps tries within TRY_COST."""
        fast, slow = (self.spec, self.plain) if self.winner else (self.plain, self.spec)
        if fast.round_seconds > 0:
            floor = (slow.round_seconds / fast.round_seconds - 1.0) / TRY_COST
            self.interval = int(min(max(self.interval, floor), MAX))


class SpecGate:
    """Per-bucket choice between speculative and plain rounds; see the module docstring."""

    def __init__(self):
        self.buckets: dict[int, Bucket] = {}
        self.decisions = {True: 0, False: 0}

    def _bucket(self, batch: int) -> Bucket:
        return self.buckets.setdefault(bucket_of(batch), Bucket())

    def _below_runs_plain(self, batch: int) -> bool:
        """Does the largest measured bucket below this batch's run plainly?"""
        b = bucket_of(batch)
        below = [k for k, bk in self.buckets.items() if k < b and bk.spec.ready and bk.plain.ready]
        return bool(below) and not self.buckets[max(below)].winner

    def choose(self, batch: int) -> bool:
        """Speculate in the next round of ``batch`` requests?"""
        fresh = bucket_of(batch) not in self.buckets
        bk = self._bucket(batch)
        if fresh and self._below_runs_plain(batch):
            bk.plain_first = True
        if bk.spec.ready and bk.plain.ready:
            choice = bk.winner != bk.try_now()
        elif bk.plain_first:   # plain until measured; the speculative arm only through tries
            choice = bk.plain.ready and bk.try_now()
        else:
            choice = not bk.spec.ready
        self.decisions[choice] += 1
        return choice

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """The round just run: its arm, the tokens it produced and its wall-clock seconds."""
        if seconds <= 0 or tokens <= 0:
            return
        bk = self._bucket(batch)
        before = bk.winner
        arm, other = (bk.spec, bk.plain) if speculated else (bk.plain, bk.spec)
        if bk.trying and other.ready and tokens / seconds > other.speed:
            arm.rounds.clear()   # a try beat the winner: the arm's older rounds are stale
        arm.add(tokens, seconds)
        if bk.trying:
            bk.trying = False
            bk.interval = min(2 * bk.interval, MAX) if bk.winner == before else MIN
            if bk.spec.ready and bk.plain.ready:
                bk.spaced()
        elif bk.winner != before:   # the winner's own rounds got slower: watch closely again
            bk.interval = MIN

    def snapshot(self) -> dict[int, dict]:
        """Per bucket: both arms' speeds (tokens/s; None before their warm-up) and the choice."""
        return {b: {"speculative": round(bk.spec.speed, 1) if bk.spec.ready else None,
                    "plain": round(bk.plain.speed, 1) if bk.plain.ready else None,
                    "speculating": bk.winner}
                for b, bk in sorted(self.buckets.items())}
