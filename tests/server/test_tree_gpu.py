"""speculative/tree_gpu.py: the tensor-op DDTree equals the heap's best-first tree (speculative/tree.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.decode import ddtree_builder, tree_inputs
from ddtree_server.speculative.tree import _make, build_ddtree
from ddtree_server.speculative.tree_gpu import build_ddtree_device, device_tree_inputs


def _paths(tokens, parents) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_same_node_set_as_the_heap(seed):
    g = torch.Generator().manual_seed(seed)
    depth, vocab, budget = (3, 7, 15)[seed % 3], (40, 300)[seed % 2], (1, 2, 16, 33, 64, 100)[seed % 6]
    logits = torch.randn(depth, vocab, generator=g) * (1 + seed % 4)
    vals, ids = torch.log_softmax(logits, -1).topk(min(budget, vocab), -1)
    host = build_ddtree(5, vals.numpy(), ids.numpy(), budget)
    tokens, depths, parents, mask = build_ddtree_device(vals, ids, 5, budget)
    assert tokens.shape == (budget + 1,) and int(tokens[0]) == 5 and int(parents[0]) == -1
    assert _paths(host.tokens, host.parents) == _paths(tokens.tolist(), parents.tolist())
    assert all(0 <= parents[i] < i for i in range(1, budget + 1))
    assert (depths[1:] == depths[parents[1:]] + 1).all()
    tree = _make(tokens.tolist(), depths.tolist(), parents.tolist())
    assert torch.equal(torch.from_numpy(tree.ancestors()), mask)


def test_device_tree_inputs_match_the_host_builder():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(15, 500, generator=g) * 3
    ids, pos, mask = device_tree_inputs(logits, 9, 32, 100)
    host = ddtree_builder(logits, 9, 32)
    h_ids, h_pos, _ = tree_inputs(host, 100, "cpu")
    assert _paths(ids.tolist(), build_ddtree_device(*torch.log_softmax(logits, -1).topk(32, -1), 9, 32)[2].tolist()) \
        == _paths(host.tokens, host.parents)
    assert sorted(pos.tolist()) == sorted(h_pos.tolist()) and mask.shape == (33, 33)


def test_too_few_prefixes_and_bad_tables_are_refused():
    vals, ids = torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="prefixes"):
        build_ddtree_device(vals, ids, 0, 7)  # 2 + 4 = 6 prefixes exist
    with pytest.raises(ValueError, match="both be"):
        build_ddtree_device(vals, ids[:1], 0, 2)
