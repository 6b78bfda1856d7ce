"""DDTree construction (speculative/tree.py): Algorithm 1 invariants and optimality on small cases."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from ddtree_server.speculative.tree import build_ddtree, chain_tree, root_only


def _tables(depth, k, seed, vocab=50):
    """Random sorted top-K log-prob tables with unique ids per row."""
    rng = random.Random(seed)
    logp, ids = [], []
    for _ in range(depth):
        raw = [rng.gauss(0, 2) for _ in range(vocab)]
        z = math.log(sum(math.exp(x) for x in raw))
        order = sorted(range(vocab), key=lambda i: -raw[i])[:k]
        logp.append([raw[i] - z for i in order])
        ids.append(order)
    return logp, ids


def _prefix_logp(tree, logp, ids, node):
    total = 0.0
    while node > 0:
        d = tree.depths[node]
        total += logp[d - 1][ids[d - 1].index(tree.tokens[node])]
        node = tree.parents[node]
    return total


@pytest.mark.parametrize("budget", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariants(budget, seed):
    logp, ids = _tables(depth=6, k=8, seed=seed)
    tree = build_ddtree(7, logp, ids, budget)
    assert tree.size == 1 + min(budget, 6 * 8)
    assert tree.tokens[0] == 7 and tree.depths[0] == 0 and tree.parents[0] == -1
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert 0 <= p < i
        assert tree.depths[i] == tree.depths[p] + 1 <= 6
        assert tree.children[p][tree.tokens[i]] == i
    # siblings appear in rank order
    for node in range(tree.size):
        kids = sorted(tree.children[node].values())
        ranks = [ids[tree.depths[c] - 1].index(tree.tokens[c]) for c in kids]
        assert ranks == list(range(len(ranks)))
    anc = tree.ancestors()
    for i in range(tree.size):
        chain, j = set(), i
        while j >= 0:
            chain.add(j)
            j = tree.parents[j]
        assert set(np.flatnonzero(anc[i])) == chain


@pytest.mark.parametrize("seed", range(5))
def test_optimal_set_of_prefixes(seed):
    """Prop. 2: the tree is the set of the B most probable prefixes (brute force)."""
    depth, k, budget = 3, 4, 12
    logp, ids = _tables(depth, k, seed)
    tree = build_ddtree(0, logp, ids, budget)
    got = sorted((_prefix_logp(tree, logp, ids, i) for i in range(1, tree.size)), reverse=True)
    every = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            every.append(sum(logp[i][r] for i, r in enumerate(ranks)))
    best = sorted(every, reverse=True)[:budget]
    assert got == pytest.approx(best, abs=1e-9)
    # pop order is non-increasing in prefix probability
    seq = [_prefix_logp(tree, logp, ids, i) for i in range(1, tree.size)]
    assert all(a >= b - 1e-12 for a, b in zip(seq, seq[1:]))


def test_ties_broken_by_rank_tuple():
    logp = [[math.log(0.5), math.log(0.5)], [math.log(0.5), math.log(0.5)]]
    ids = [[10, 11], [20, 21]]
    tree = build_ddtree(1, logp, ids, 6)
    # (0,) (1,) tie -> (0,) first; then (0,0) (0,1) (1,0) (1,1) all 0.25 in tuple order
    assert tree.tokens == [1, 10, 11, 20, 21, 20, 21]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2]


def test_flat_distribution_gives_all_siblings():
    logp = [[math.log(1 / 16)] * 16 for _ in range(4)]
    ids = [list(range(16)) for _ in range(4)]
    tree = build_ddtree(0, logp, ids, 16)
    assert tree.depths[1:] == [1] * 16


def test_fast_paths_and_chain_detection():
    logp, ids = _tables(depth=5, k=3, seed=3)
    assert build_ddtree(5, logp, ids, 0).tokens == [5]
    one = build_ddtree(5, logp, ids, 1)
    assert one.tokens == [5, ids[0][0]] and one.is_chain
    peaked = [[0.0, -50.0, -60.0] for _ in range(5)]
    tree = build_ddtree(5, peaked, ids, 5)
    assert tree.is_chain and tree.tokens == [5] + [row[0] for row in ids]
    c = chain_tree(3, [4, 5, 6])
    assert c.is_chain and c.depths == [0, 1, 2, 3] and c.parents == [-1, 0, 1, 2]
    assert root_only(9).size == 1 and root_only(9).ancestors().tolist() == [[True]]


def test_budget_larger_than_tree_space():
    logp, ids = _tables(depth=2, k=3, seed=4)
    tree = build_ddtree(0, logp, ids, 100)
    assert tree.size == 1 + 3 + 9


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        build_ddtree(0, [[0.0, -1.0]], [[1]], 2)


def test_tree_inputs_one_buffer_matches_the_tree():
    import torch

    from ddtree_server.engine.decode import tree_inputs

    logp = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]]))
    ids = np.array([[11, 12, 13], [21, 22, 23], [31, 32, 33]])
    tree = build_ddtree(7, logp, ids, budget=6)
    tok, pos, mask = tree_inputs(tree, 100, "cpu")
    assert tok.tolist() == tree.tokens and pos.tolist() == [100 + d for d in tree.depths]
    assert mask.dtype == torch.bool and (mask.numpy() == tree.ancestors()).all()
    chain = chain_tree(7, [1, 2, 3])
    tok, pos, mask = tree_inputs(chain, 5, "cpu")
    assert mask is None and tok.tolist() == [7, 1, 2, 3] and pos.tolist() == [5, 6, 7, 8]
