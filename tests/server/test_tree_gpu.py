"""speculative/tree_gpu.py: the tensor-op DDTree equals the heap's best-first tree (speculative/tree.py)."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.engine.decode import ddtree_builder, tree_inputs
from ddtree_server.speculative.tree import _make, build_ddtree, tree_from_arrays
from ddtree_server.speculative.tree_gpu import (build_ddtree_device, build_trees_device, device_tree_inputs, draft_trees,
                                               topk_logp, topk_rows_chunked)


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


def _tables(seed, b, depth, k, vocab=500, scale=3.0, dtype=torch.float64):
    """Sorted top-K log-prob tables ``[b, L, K]`` (fp32 values, held in ``dtype``) and their ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, depth, vocab, generator=g) * scale
    vals, ids = torch.log_softmax(logits, -1).topk(k, -1)
    return vals.to(dtype), ids


def _score(logp, ids, tokens, parents, depths, node):
    total = 0.0
    while node > 0:
        d = depths[node] - 1
        total += float(logp[d][(ids[d] == tokens[node]).nonzero()[0, 0]])
        node = parents[node]
    return total


def _check_tree(tree):
    assert tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, tree.size):
        p = tree.parents[i]
        assert 0 <= p < i and tree.depths[i] == tree.depths[p] + 1
    assert len({(tree.parents[i], tree.tokens[i]) for i in range(1, tree.size)}) == tree.size - 1


@pytest.mark.parametrize("seed", range(6))
def test_batched_build_equals_the_heap_per_request(seed):
    """b requests, caps 1..64 (incl. caps above K), L = block size - 1 = 15: every request's tree
    has the heap's node set for its own cap (exact sums in float64 of fp32 log-probs)."""
    b, depth, k = 7, 15, (64, 8, 3)[seed % 3]
    logp, ids = _tables(seed, b, depth, k, scale=(1.0, 3.0)[seed % 2])
    caps = [1, 64, 2, 17, 33, 5, 64] if seed % 2 else [64, 3, 64, 9, 1, 48, 16]
    width = max(caps)
    tokens, depths, parents, counts = build_trees_device(logp, ids, width)
    assert tokens.shape == depths.shape == parents.shape == (b, width) and counts.tolist() == [width] * b
    for i, cap in enumerate(caps):
        host = build_ddtree(11, logp[i].numpy(), ids[i].numpy(), cap)
        tree = tree_from_arrays(11, tokens[i, :cap], depths[i, :cap], parents[i, :cap])
        _check_tree(tree)
        assert tree.size == host.size == cap + 1
        assert _paths(tree.tokens, tree.parents) == _paths(host.tokens, host.parents)
        anc = tree.ancestors()
        for j in range(tree.size):
            line, a = set(), j
            while a >= 0:
                line.add(a)
                a = tree.parents[a]
            assert set(anc[j].nonzero()[0].tolist()) == line


@pytest.mark.parametrize("seed", range(4))
def test_ties_and_certain_tokens_keep_trees_prefix_closed(seed):
    """Log-probs rounded to 0.5 (many exact ties, some exactly 0): every prefix of the order is a
    tree (parents first) and its scores are the heap's scores (the node set up to tied choices)."""
    b, depth, k = 5, 6, 4
    logp, ids = _tables(seed, b, depth, k, vocab=30, scale=4.0)
    logp = (logp * 2).round() / 2
    logp = logp.sort(dim=-1, descending=True).values
    width = 40
    tokens, depths, parents, counts = build_trees_device(logp, ids, width)
    for i in range(b):
        for cap in (1, 7, 23, 40):
            t = tree_from_arrays(0, tokens[i, :cap], depths[i, :cap], parents[i, :cap])
            _check_tree(t)
            host = build_ddtree(0, logp[i].numpy(), ids[i].numpy(), cap)
            mine = sorted(_score(logp[i], ids[i], t.tokens, t.parents, t.depths, j) for j in range(1, t.size))
            theirs = sorted(_score(logp[i], ids[i], host.tokens, host.parents, host.depths, j) for j in range(1, host.size))
            assert mine == theirs


def test_counts_when_fewer_prefixes_exist():
    logp, ids = _tables(0, 2, 2, 2)          # 2 + 4 = 6 prefixes per request
    tokens, depths, parents, counts = build_trees_device(logp, ids, 10)
    assert counts.tolist() == [6, 6]
    trees = draft_trees(torch.randn(3, 2, 2), [1, 2, 3], [10, 0, 4])
    assert [t.size for t in trees] == [7, 1, 5] and [t.tokens[0] for t in trees] == [1, 2, 3]
    with pytest.raises(ValueError, match="both be"):
        build_trees_device(logp[0], ids[0], 3)
    with pytest.raises(ValueError, match="width"):
        build_trees_device(logp, ids, 0)


@pytest.mark.parametrize("seed", range(3))
def test_draft_trees_from_logits_equal_ddtree_builder(seed):
    """The batch engine's entry (fp32 log_softmax + top-K on the draft logits, one build, one copy)
    against the per-request host builder, caps 0..64."""
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(6, 15, 2000, generator=g) * (2 + seed)
    caps, roots = [0, 1, 16, 64, 40, 7], [5, 6, 7, 8, 9, 10]
    trees = draft_trees(logits, roots, caps)
    for i, cap in enumerate(caps):
        host = ddtree_builder(logits[i], roots[i], cap)
        _check_tree(trees[i])
        assert trees[i].size == host.size and trees[i].tokens[0] == roots[i]
        assert _paths(trees[i].tokens, trees[i].parents) == _paths(host.tokens, host.parents)
        assert trees[i].is_chain == host.is_chain


@pytest.mark.parametrize("step", [1, 5, 7, 64])
def test_top_k_in_passes_equals_one_pass(step):
    """A batch's draft logits are reduced in passes of bounded memory (tree_gpu.CHUNK_BYTES):
    the same values and ids, bitwise, as one log_softmax + top-K over all rows."""
    g = torch.Generator().manual_seed(step)
    logits = torch.randn(3, 5, 97, generator=g).to(torch.bfloat16)
    logits[1, 2, 10:20] = logits[1, 2, 10]   # ties
    whole_v, whole_i = torch.log_softmax(logits.float(), dim=-1).topk(6, dim=-1)
    vals, ids = topk_rows_chunked(logits, 6, step)
    assert vals.shape == (3, 5, 6) and ids.shape == (3, 5, 6)
    assert torch.equal(vals, whole_v) and torch.equal(ids, whole_i)
    per_request = topk_logp(logits, 6)   # the CPU path: request by request
    assert torch.equal(per_request[0], whole_v) and torch.equal(per_request[1], whole_i)
