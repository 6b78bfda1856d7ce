"""One global node budget over several requests' draft trees (pure, CPU only).

Under DDTree's factorised surrogate the expected accepted length of a request's tree is the sum
of its nodes' prefix probabilities (docs/ddtree.md §2.2), and that sum is separable over the
requests of a round. So for N draft nodes in all, the best trees are the N most probable prefixes
across every request: one best-first over the union of the requests' candidates, i.e. a merge of
each request's ``best_first`` stream (``spec/tree.py``), each cut at its cap (its tree budget and
cache room). Each request's selection is a prefix of its own stream, hence prefix-closed and the
same tree ``build_ddtree`` gives for its node count. A request weight ``w_r`` (the policy's
calibration of the drafter's probabilities, ``engine/batch/policy.py``) scales its prefix
probabilities; the merge then ranks by ``w_r * p``, which is still optimal for the weighted sum
because each stream's gains do not increase.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

from ddtree_server.speculative.tree import DraftTree, best_first, topk_rows, tree_of


@dataclass
class Ranked:
    """Candidate nodes of a round in decreasing weighted prefix probability: ``gains[j]`` (w_r * p)
    and ``owner[j]`` (request index) of the j-th candidate, and each request's stream items
    (``best_first`` tuples, in order) up to its cap."""

    gains: list[float]
    owner: list[int]
    nodes: list[list[tuple[float, int, int, int]]]

    def add(self, gain: float, r: int, item: tuple) -> None:
        self.gains.append(gain)
        self.owner.append(r)
        self.nodes[r].append(item)

    def counts(self, total: int) -> list[int]:
        """Draft nodes per request when the round spends ``total`` nodes (the first ``total`` candidates)."""
        out = [0] * len(self.nodes)
        for i in self.owner[:max(total, 0)]:
            out[i] += 1
        return out

    def trees(self, roots: Sequence[int], total: int) -> list[DraftTree]:
        """Each request's tree (root = its bonus token) under a round total of ``total`` nodes."""
        return [tree_of(root, nodes[:n]) for root, nodes, n in zip(roots, self.nodes, self.counts(total))]

    def mass(self, counts: Sequence[int]) -> list[float]:
        """Unweighted expected accepted draft tokens (sum of prefix probabilities) per request."""
        return [sum(math.exp(x[0]) for x in nodes[:n]) for nodes, n in zip(self.nodes, counts)]


def merged(tables: Sequence[tuple], caps: Sequence[int], weights: Sequence[float] | None = None
           ) -> Iterator[tuple[float, int, tuple]]:
    """The requests' best-first streams merged: ``(gain, request, item)`` in decreasing gain
    (``w_r * p``), ``item`` a ``best_first`` tuple of request r. ``tables[r]``: ``(topk_logp [L, K],
    topk_ids [L, K])`` as for ``build_ddtree``; ``caps[r]``: its most nodes; ``weights[r] >= 0``
    (default 1; 0 drops the request). Ties keep request order."""
    weights = [1.0] * len(tables) if weights is None else list(weights)
    streams = [_stream(r, topk_rows(logp, ids), cap, math.log(weights[r])) if cap > 0 and weights[r] > 0
               else iter(()) for r, ((logp, ids), cap) in enumerate(zip(tables, caps))]
    for score, r, item in heapq.merge(*streams, key=lambda e: -e[0]):
        yield math.exp(score), r, item


def rank(tables: Sequence[tuple], caps: Sequence[int], weights: Sequence[float] | None = None,
         limit: int | None = None) -> Ranked:
    """The first ``limit`` (default: all, ``sum(caps)``) candidates of ``merged``."""
    out = Ranked([], [], [[] for _ in tables])
    for gain, r, item in itertools.islice(merged(tables, caps, weights), limit):
        out.add(gain, r, item)
    return out


def _stream(r: int, rows: tuple, cap: int, log_w: float):
    for item in itertools.islice(best_first(*rows, cap), cap):
        yield item[0] + log_w, r, item


def allocate(tables: Sequence[tuple], caps: Sequence[int], total: int,
             weights: Sequence[float] | None = None) -> list[int]:
    """Draft nodes per request of the ``total`` most probable prefixes across all requests."""
    return rank(tables, caps, weights, limit=max(total, 0)).counts(total)
