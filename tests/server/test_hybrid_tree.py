"""Tree verification through Gated DeltaNet layers is exact: every node's logits (and captured
features) equal running its root path as a plain chain, for both GDN tree methods, random trees
(depth up to 16), several layer patterns, and over several rounds (verify, keep, verify again).

The reference for a node is a fresh cache that prefills prefix + the node's root path as a
chain (the chunked prefill path, no tree code involved).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.server.hybrid_fixtures import tiny_hybrid

TOL = 1e-4
METHODS = ("chunk", "node")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def random_tree(n: int, max_depth: int, rng: random.Random, shape: str) -> list[int]:
    """parents[i] < i; 'chain' (depth n-1), 'star' (all under the root), 'bushy', 'deep'."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        if shape == "chain":
            p = i - 1
        elif shape == "star":
            p = 0
        else:
            cands = [j for j in range(i) if depth[j] < max_depth]
            p = max(cands) if shape == "deep" and rng.random() < 0.6 else rng.choice(cands)
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def root_path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def chain_logits(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Last row's logits and features of a plain chain forward over ``seq`` on a fresh cache."""
    cache = model.new_cache(len(seq) + 8, tree_rows=4)  # scratch < len: committed chunked prefill
    logits, feats = model.forward(cache, torch.tensor(seq), torch.arange(len(seq)))
    return logits[-1], (feats[-1] if feats is not None else None)


def verify(model, cache, tokens, parents, start):
    anc = ancestors(parents)
    depth = anc.sum(1) - 1
    return model.forward(cache, torch.tensor(tokens), depth + start, tree_mask=anc)


CASES = [("3gdn+attn", "chain", 17), ("3gdn+attn", "star", 9), ("mixed6", "bushy", 33),
         ("attn-first", "deep", 65), ("3gdn+attn", "deep", 40)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pattern,shape,n", CASES)
def test_every_node_equals_its_root_path_as_a_chain(method, pattern, shape, n):
    model = tiny_hybrid(pattern, seed=11, method=method)
    model.capture_layers = [0, len(model.layers) - 2]
    rng = random.Random(n)
    prefix = [rng.randrange(256) for _ in range(23)]
    parents = random_tree(n, 16, rng, shape)
    tokens = [rng.randrange(256) for _ in range(n)]
    with torch.no_grad():
        cache = model.new_cache(200)
        model.forward(cache, torch.tensor(prefix), torch.arange(len(prefix)))
        logits, feats = verify(model, cache, tokens, parents, len(prefix))
        for node in range(n):
            path = root_path(parents, node)
            assert len(path) <= 17
            want, want_f = chain_logits(model, prefix + [tokens[j] for j in path])
            assert (logits[node] - want).abs().max() <= TOL, node
            assert (feats[node] - want_f).abs().max() <= TOL, node


@pytest.mark.parametrize("method", METHODS)
def test_multi_round_commit_then_verify_again(method):
    """Three rounds: verify a tree, keep a path that is NOT the first child's, verify the next
    tree on top; every round's nodes equal chains over everything committed so far, and the
    committed recurrent / conv states equal a chain's."""
    model = tiny_hybrid("3gdn+attn", seed=12, method=method)
    rng = random.Random(5)
    seq = [rng.randrange(256) for _ in range(19)]
    with torch.no_grad():
        cache = model.new_cache(300)
        model.forward(cache, torch.tensor(seq), torch.arange(len(seq)))
        for rnd in range(3):
            parents = random_tree(30, 16, rng, "bushy")
            tokens = [rng.randrange(256) for _ in range(30)]
            s = len(seq)
            logits, _ = verify(model, cache, tokens, parents, s)
            for node in rng.sample(range(30), 8):
                want, _ = chain_logits(model, seq + [tokens[j] for j in root_path(parents, node)])
                assert (logits[node] - want).abs().max() <= TOL, (rnd, node)
            leaf = max(range(30), key=lambda i: (len(root_path(parents, i)), root_path(parents, i)[1:2] != [1]))
            path = root_path(parents, leaf)
            assert path != list(range(len(path))), "the kept path must leave the first-child spine"
            cache.keep(s, path)
            seq += [tokens[j] for j in path]
            assert cache.length == len(seq)
            ref = model.new_cache(300, tree_rows=4)
            model.forward(ref, torch.tensor(seq), torch.arange(len(seq)))
            assert (cache.state - ref.state).abs().max() <= 1e-4
            assert (cache.conv[:, :3] - ref.conv[:, :3]).abs().max() <= 1e-5
            n_attn = cache.kv.k.shape[0]
            assert n_attn and (cache.kv.k[:, :, :len(seq)] - ref.kv.k[:, :, :len(seq)]).abs().max() <= 1e-4


def test_methods_agree_and_chain_blocks_roll_back():
    """DFlash-style chain verify (no mask) then keep of a prefix: next token equals a chain."""
    a, b = tiny_hybrid("mixed6", seed=13, method="chunk"), tiny_hybrid("mixed6", seed=13, method="node")
    rng = random.Random(9)
    prefix = [rng.randrange(256) for _ in range(10)]
    block = [rng.randrange(256) for _ in range(16)]
    with torch.no_grad():
        for model in (a, b):
            cache = model.new_cache(100)
            model.forward(cache, torch.tensor(prefix), torch.arange(10))
            out, _ = model.forward(cache, torch.tensor(block), torch.arange(10, 26))
            cache.keep(10, range(5))
            nxt, _ = model.forward(cache, torch.tensor([7]), torch.tensor([15]))
            want, _ = chain_logits(model, prefix + block[:5] + [7])
            assert (nxt[0] - want).abs().max() <= TOL
            want_block, _ = chain_logits(model, prefix + block)
            assert (out[-1] - want_block).abs().max() <= TOL


def test_keep_rules():
    model = tiny_hybrid("3gdn+attn", seed=14)
    with torch.no_grad():
        cache = model.new_cache(100)
        model.forward(cache, torch.arange(5), torch.arange(5))
        parents = [-1, 0, 0, 1]
        verify(model, cache, [1, 2, 3, 4], parents, 5)
        with pytest.raises(RuntimeError, match="keep"):
            model.forward(cache, torch.tensor([1]), torch.tensor([9]))  # tree not committed
        with pytest.raises(ValueError):
            cache.keep(5, [0, 4])  # outside the block
        with pytest.raises(ValueError):
            cache.keep(6, [0])  # wrong start
        cache.keep(5, [0, 2])
        assert cache.length == 7 and cache.pending is None
        model.forward(cache, torch.tensor([3]), torch.tensor([7]))  # one token: committed at once
        cache.keep(7, [0])  # keeping it in full is fine
        with pytest.raises(ValueError, match="no rollback"):
            cache.keep(7, [])
        seq = [0, 1, 2, 3, 4, 1, 3, 3]
        parents = [-1] + [max(0, i - 2) for i in range(1, 90)]  # 90 nodes > the 80-row scratch: it grows
        tokens = [(7 * i) % 256 for i in range(90)]
        logits, _ = verify(model, cache, tokens, parents, 8)
        assert cache.cap == 96
        path = root_path(parents, 89)
        assert (logits[89] - chain_logits(model, seq + [tokens[j] for j in path])[0]).abs().max() <= TOL
        cache.keep(8, path)
        nxt, _ = model.forward(cache, torch.tensor([5]), torch.tensor([cache.length]))
        assert (nxt[0] - chain_logits(model, seq + [tokens[j] for j in path] + [5])[0]).abs().max() <= TOL
        cache.reset()
        assert cache.length == 0 and float(cache.state.abs().sum()) == 0.0
