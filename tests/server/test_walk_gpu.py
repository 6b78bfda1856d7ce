"""speculative/walk_gpu.py: the batched parent-compare walk equals ``walk.walk`` per tree."""

from __future__ import annotations

import random

import torch

from ddtree_server.speculative.tree import build_ddtree, chain_tree, root_only
from ddtree_server.speculative.walk import walk
from ddtree_server.speculative.walk_gpu import walk_all

from tests.server.batch_fixtures import Unpinned


def _trees(rng):
    out = []
    for _ in range(rng.randint(1, 9)):
        kind = rng.random()
        if kind < 0.15:
            out.append(root_only(rng.randrange(8)))
        elif kind < 0.3:
            out.append(chain_tree(rng.randrange(8), [rng.randrange(8) for _ in range(rng.randint(1, 6))]))
        else:
            g = torch.Generator().manual_seed(rng.randrange(10**6))
            vals, ids = torch.log_softmax(torch.randn(rng.randint(1, 6), 8, generator=g) * 2, -1).topk(4, -1)
            out.append(build_ddtree(rng.randrange(8), vals.double().numpy(), ids.numpy(), rng.randint(1, 40)))
    return out


def test_walk_all_equals_walk_per_tree():
    rng = random.Random(0)
    for _ in range(120):
        trees = _trees(rng)
        gaps = [rng.choice([0, 0, 3]) for _ in trees]            # padding rows between blocks
        offsets, at = [], 0
        for t, g in zip(trees, gaps):
            offsets.append(at)
            at += t.size + g
        choices = torch.tensor([rng.randrange(8) for _ in range(at + rng.choice([0, 2]))])
        for t, a in zip(trees, offsets):   # steer some choices down the tree (long paths)
            for i in range(t.size):
                kids = list(t.children[i])
                if kids and rng.random() < 0.7:
                    choices[a + i] = rng.choice(kids)
        expect = [walk(t, choices[a:a + t.size].tolist()) for t, a in zip(trees, offsets)]
        assert walk_all(choices, trees, offsets) == expect
        assert walk_all(choices, trees, offsets, Unpinned()) == expect
