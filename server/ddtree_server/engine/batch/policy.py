"""The speculation policy of the batch engine: how many draft nodes a round verifies, and whose
(pure bookkeeping: no tensors; the round's model I/O is ``runner.py``).

Each round maximises the expected tokens per second of the whole batch,

    (b + sum_r w_r * E_r[accepted draft tokens]) / (T(b, b + N + fixed) + D(drafting)),

over N, the draft nodes spent on the requests it governs (``ddtree`` requests under
``--spec-policy auto``): for a given N the best trees are the N most probable prefixes across
those requests (``spec/budget.py``), and a tree's expected accepted length is the sum of its
nodes' prefix probabilities. ``T(b, rows)`` is the target forward over ``rows`` rows of ``b``
requests and ``D(d)`` the drafter's block forward for ``d`` requests (``Profile``: measured at
start-up, ``profile.py``, or given). ``w_r`` calibrates request r's draft probabilities with its
acceptance observed online: the ratio of exponential moving averages of its accepted and its
predicted draft tokens per round (drafters are miscalibrated; a useless drafter's weight falls
towards 0). N = 0 is plain decoding (every tree the root alone); a request whose tree comes out as
one path is a chain: plain, chain and tree are points on one curve.

One round ahead: a governed request that got no node, or any governed request of a round whose
best plan is slower than plain decoding (the drafter's cost included), skips the drafter for its
next ``backoff`` rounds (1, 2, 4 ... ``MAX_BACKOFF``; halved by each round that accepts a draft
token of it); while it skips, its moving averages decay (by ``EMA / 4`` a round), so a later
probe trusts the drafter's probabilities more again.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from ddtree_server.speculative.budget import Ranked, merged
from ddtree_server.speculative.tree import DraftTree

POLICIES = ("auto", "fixed")
EMA = 0.3            # weight of the newest round in a request's moving averages
PRIOR = 0.05         # tokens added to both averages: the calibration weight starts near 1
MAX_WEIGHT = 4.0
MAX_BACKOFF = 32     # rounds a request may skip the drafter in a row


@dataclass
class Profile:
    """Seconds of a round's parts: ``target(b, rows)`` interpolates the measured forward times
    ``seconds`` at row counts ``rows`` (ascending; linear between and beyond the points) plus
    ``per_request`` seconds per request; ``drafter(d)`` is ``draft`` (one request's block of
    ``block`` rows) scaled by the target's row curve to ``d`` blocks (0 when nobody drafts)."""

    rows: Sequence[int]
    seconds: Sequence[float]
    per_request: float = 0.0
    draft: float = 0.0
    block: int = 16

    @classmethod
    def linear(cls, base: float, per_row: float, *, per_request: float = 0.0, draft: float = 0.0,
               block: int = 16) -> "Profile":
        """``T(b, rows) = base + per_row * (rows - 1) + per_request * b`` (tests; analytic models)."""
        return cls([1, 4097], [base, base + 4096 * per_row], per_request, draft, block)

    def target(self, b: int, rows: int) -> float:
        xs, ys = self.rows, self.seconds
        if len(xs) == 1:
            return ys[0] + self.per_request * b
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (rows - x0) / (x1 - x0), ys[0]) + self.per_request * b

    def drafter(self, d: int) -> float:
        if d <= 0 or self.draft <= 0:
            return 0.0
        return self.draft * self.target(1, d * self.block) / self.target(1, self.block)

    @property
    def max_rows(self) -> int:
        """The largest measured row count (a round never plans more than twice as many rows)."""
        return int(self.rows[-1])


@dataclass
class SpecState:
    """A governed request's policy state: moving averages of its predicted and accepted draft
    tokens per round, the back-off, and the prediction of the round in flight."""

    predicted: float = 0.0
    accepted: float = 0.0
    skip: int = 0
    backoff: int = 1
    pending: float | None = None

    @property
    def weight(self) -> float:
        return min((self.accepted + PRIOR) / (self.predicted + PRIOR), MAX_WEIGHT)


@dataclass
class Plan:
    """One round's choice: ``nodes`` (N) over the governed requests, their trees and expected
    accepted draft tokens (calibrated), and the speeds (tokens/s) of the plan and of plain decoding."""

    nodes: int
    trees: list[DraftTree]
    expected: float
    speed: float
    plain_speed: float
    counts: list[int] = field(default_factory=list)


class SpecPolicy:
    """Chooses each round's node total and trees; ``state(req)`` holds a request's bookkeeping."""

    def __init__(self, profile: Profile | None = None):
        self.profile = profile   # None: measured by the runner before the first plan
        self.last: Plan | None = None

    @staticmethod
    def state(req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState()
        return req.spec

    def drafts(self, req) -> bool:
        """Does a governed request draft this round? (False while it backs off; its averages decay.)"""
        st = self.state(req)
        if st.skip > 0:
            st.skip -= 1
            st.predicted *= 1 - EMA / 4
            st.accepted *= 1 - EMA / 4
            return False
        return True

    def plan(self, b: int, fixed_rows: int, drafting: int, tables: Sequence[tuple], caps: Sequence[int],
             roots: Sequence[int], reqs: Sequence) -> Plan:
        """Trees for the governed requests ``reqs`` (their top-K tables, caps and roots) in a round
        of ``b`` requests that also verifies ``fixed_rows`` draft rows of ungoverned requests and
        runs the drafter for ``drafting`` requests."""
        prof, states = self.profile, [self.state(r) for r in reqs]
        limit = max(2 * prof.max_rows - b - fixed_rows, 0)   # rows past twice the measured ones: never
        draft_s = prof.drafter(drafting)
        cost = lambda n: prof.target(b, b + fixed_rows + n) + draft_s   # noqa: E731 - seconds of n nodes
        ranked = Ranked([], [], [[] for _ in reqs])
        best_n, best, best_gain, gain = 0, b / cost(0), 0.0, 0.0
        bends = [x - b - fixed_rows for x in prof.rows if x - b - fixed_rows > 0] + [limit]
        for g, r, item in merged(tables, caps, [s.weight for s in states]):
            n = len(ranked.gains)
            if n >= limit:
                break
            ranked.add(g, r, item)
            gain += g
            speed = (b + gain) / cost(n + 1)
            if speed > best:
                best_n, best, best_gain = n + 1, speed, gain
            # later gains are at most g each and T is piecewise linear: the best any larger n can
            # do is reached at a bend of T or at the limit; stop when that cannot beat the best
            if n % 8 == 7 and all((b + gain + (m - n - 1) * g) / cost(m) <= best for m in bends if m > n + 1):
                break
        plain = b / prof.target(b, b + fixed_rows)
        counts = ranked.counts(best_n)
        for st, n, mass in zip(states, counts, ranked.mass(counts)):
            st.pending = mass if n else None
            if not n or best < plain:
                st.skip, st.backoff = st.backoff, min(2 * st.backoff, MAX_BACKOFF)
        self.last = Plan(best_n, ranked.trees(roots, best_n), best_gain, best, plain, counts)
        return self.last

    def observe(self, req, accepted: int) -> None:
        """The accepted draft tokens (path length - 1) of a governed request's round."""
        st = self.state(req)
        if st.pending is None:
            return
        if st.predicted == 0.0 and st.accepted == 0.0:
            st.predicted, st.accepted = st.pending, float(accepted)
        else:
            st.predicted += EMA * (st.pending - st.predicted)
            st.accepted += EMA * (accepted - st.accepted)
        st.pending = None
        if accepted > 0:   # the drafter helped: probe twice as often
            st.backoff = max(st.backoff // 2, 1)
