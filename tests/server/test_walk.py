"""Acceptance walk (speculative/walk.py): greedy paths and sample-and-match losslessness (pure, CPU)."""

from __future__ import annotations

import collections
import math
import random

import pytest

from ddtree_server.speculative.tree import build_ddtree, chain_tree
from ddtree_server.speculative.walk import accepted_tokens, walk


def _tree():
    # root 0 -> {1: a, 2: b}; a -> {3: c, 4: d}; b -> {5: e}; c -> {6: f}
    logp = [[-0.1, -2.0], [-0.2, -1.0], [-0.3, -5.0]]
    ids = [[100, 101], [200, 201], [300, 301]]
    return build_ddtree(1, logp, ids, 6)


def test_walk_follows_children_and_stops_at_first_miss():
    tree = _tree()
    choices = [0] * tree.size
    choices[0] = 100
    node_a = tree.children[0][100]
    choices[node_a] = 201
    node = tree.children[node_a][201]
    choices[node] = 999
    path, bonus = walk(tree, choices)
    assert path == [0, node_a, node] and bonus == 999
    assert accepted_tokens(tree, path, bonus) == [100, 201, 999]


def test_walk_root_miss():
    tree = _tree()
    path, bonus = walk(tree, [55] + [0] * (tree.size - 1))
    assert path == [0] and bonus == 55


def test_walk_sibling_branch():
    tree = _tree()
    choices = [0] * tree.size
    choices[0] = 101
    b = tree.children[0][101]
    choices[b] = 7
    path, bonus = walk(tree, choices)
    assert path == [0, b] and bonus == 7 and path == sorted(path)


def test_walk_full_chain():
    tree = chain_tree(1, [2, 3, 4])
    path, bonus = walk(tree, [2, 3, 4, 5])
    assert path == [0, 1, 2, 3] and bonus == 5


def test_wrong_length_raises():
    with pytest.raises(ValueError):
        walk(chain_tree(1, [2]), [2])


def test_sample_and_match_is_lossless():
    """Emitted 3-token prefixes follow the target's conditional law exactly (chi-square)."""
    vocab = 4
    rng = random.Random(1234)

    def cond(prefix):  # a fixed, prefix-dependent target distribution over 4 tokens
        r = random.Random(hash(tuple(prefix)) & 0xFFFF)
        w = [r.random() + 0.1 for _ in range(vocab)]
        z = sum(w)
        return [x / z for x in w]

    logp = [[math.log(0.6), math.log(0.3)], [math.log(0.7), math.log(0.2)]]
    ids = [[0, 1], [2, 0]]
    tree = build_ddtree(9, logp, ids, 5)
    counts = collections.Counter()
    trials = 20000
    for _ in range(trials):
        choices = []
        for i in range(tree.size):
            prefix, j = [], i
            while j > 0:
                prefix.append(tree.tokens[j])
                j = tree.parents[j]
            choices.append(rng.choices(range(vocab), weights=cond(prefix[::-1]))[0])
        path, bonus = walk(tree, choices)
        toks = accepted_tokens(tree, path, bonus)
        # continue plain sampling up to 3 tokens so every trial yields a 3-token prefix
        while len(toks) < 3:
            toks.append(rng.choices(range(vocab), weights=cond(toks))[0])
        counts[tuple(toks[:3])] += 1
    chi2 = 0.0
    cells = 0
    for a in range(vocab):
        for b in range(vocab):
            for c in range(vocab):
                p = cond([])[a] * cond([a])[b] * cond([a, b])[c]
                exp = p * trials
                chi2 += (counts[(a, b, c)] - exp) ** 2 / exp
                cells += 1
    # 63 degrees of freedom: the 0.999 quantile is about 103
    assert chi2 < 103, chi2
