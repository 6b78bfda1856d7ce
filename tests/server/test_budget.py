"""The global node budget (speculative/budget.py): one best-first over several requests' trees.

With one request it selects exactly ``build_ddtree``'s tree; on small random cases its allocation
reaches the brute-force optimum (the largest total prefix-probability mass of prefix-closed sets
under the per-request caps and the round total), also with request weights.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from ddtree_server.speculative.budget import allocate, rank
from ddtree_server.speculative.tree import build_ddtree


def _table(rng: random.Random, depth: int, k: int, vocab: int = 50):
    logp, ids = [], []
    for _ in range(depth):
        p = np.array([rng.random() ** 3 for _ in range(vocab)])
        lp = np.log(p / p.sum())
        order = np.argsort(-lp, kind="stable")[:k]
        logp.append(lp[order].tolist())
        ids.append(order.tolist())
    return logp, ids


def _best_by_size(logp, cap: int) -> list[float]:
    """Brute force: the largest prefix-probability mass of a prefix-closed set of n nodes, n <= cap."""
    depth, k = len(logp), len(logp[0])
    nodes = [r for d in range(1, depth + 1) for r in itertools.product(range(k), repeat=d)]
    mass = {r: math.exp(sum(logp[i][x] for i, x in enumerate(r))) for r in nodes}
    best = [0.0] * (cap + 1)
    for bits in range(1 << len(nodes)):
        chosen = {nodes[i] for i in range(len(nodes)) if bits >> i & 1}
        if len(chosen) > cap or any(len(r) > 1 and r[:-1] not in chosen for r in chosen):
            continue
        best[len(chosen)] = max(best[len(chosen)], sum(mass[r] for r in chosen))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_one_request_selects_what_build_ddtree_selects(seed):
    rng = random.Random(seed)
    logp, ids = _table(rng, rng.randint(1, 6), rng.randint(1, 8))
    ranked = rank([(logp, ids)], [64])
    for n in range(0, 50):
        got = ranked.trees([7], n)[0]
        want = build_ddtree(7, logp, ids, n)
        assert (got.tokens, got.parents, got.depths) == (want.tokens, want.parents, want.depths), n
        assert allocate([(logp, ids)], [64], n) == [want.size - 1]


@pytest.mark.parametrize("seed", range(12))
def test_global_allocation_is_the_brute_force_optimum(seed):
    rng = random.Random(100 + seed)
    reqs = rng.randint(2, 3)
    tables = [_table(rng, rng.choice([2, 3]), 2) for _ in range(reqs)]
    caps = [rng.randint(0, 6) for _ in range(reqs)]
    weights = [1.0] * reqs if seed % 2 else [rng.uniform(0.2, 2.0) for _ in range(reqs)]
    curves = [[w * m for m in _best_by_size(t[0], c)] for t, c, w in zip(tables, caps, weights)]
    for total in range(0, sum(caps) + 2):
        opt = max(sum(curves[r][n] for r, n in enumerate(ns)) for ns in itertools.product(*(range(c + 1) for c in caps))
                  if sum(ns) <= total)
        ranked = rank(tables, caps, weights)
        counts = ranked.counts(total)
        assert sum(counts) == min(total, sum(caps)) and all(n <= c for n, c in zip(counts, caps))
        got = sum(w * m for w, m in zip(weights, ranked.mass(counts)))
        assert got == pytest.approx(opt, rel=1e-9, abs=1e-12), (total, counts)
        assert counts == allocate(tables, caps, total, weights)
        for tree, n in zip(ranked.trees([0] * reqs, total), counts):
            assert tree.size == n + 1 and all(tree.parents[i] < i for i in range(1, tree.size))
