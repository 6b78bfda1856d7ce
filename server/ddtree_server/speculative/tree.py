"""Pure DDTree construction: best-first draft trees from per-position draft log-probs (CPU only).

Source: Ringel & Romano, "DDTree" (arXiv 2604.12989) §3-§4, Algorithm 1, Propositions 1-3,
Lemma 1; details in docs/ddtree.md §2.2. Under the factorised surrogate Q(y_1:L) = prod_i q_i(y_i), the
expected acceptance length of a prefix-closed tree is the sum of its nodes' prefix probabilities,
so the optimal tree of B nodes is the set of the B most probable prefixes; only the per-position
top-K tokens (K = min(B, |V|)) can appear. A heap enumerates prefixes in decreasing cumulative
log-probability: popping a node pushes its next sibling (rank + 1) and its first child (rank 0 at
the next depth). Ties are broken by the rank tuple (lexicographic).

Node 0 is the root (the verified bonus token); draft nodes are numbered 1..n in pop order, so a
node's index is always larger than its parent's.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np


@dataclass
class DraftTree:
    """A draft tree of ``size = 1 + n`` nodes (node 0 = root); every parent precedes its children.

    tokens: ``[1+n]`` token ids (tokens[0] = root/bonus token); depths: ``[1+n]`` (root 0);
    parents: ``[1+n]`` (parents[0] = -1); is_chain: every node's parent is the previous node
    (causal attention is then exact); children (built on first use): per node, ``{token: child index}``.
    """

    tokens: list[int]
    depths: list[int]
    parents: list[int]
    is_chain: bool
    _children: list[dict[int, int]] | None = field(default=None, repr=False)
    _ancestors: np.ndarray | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Number of nodes including the root."""
        return len(self.tokens)

    @property
    def children(self) -> list[dict[int, int]]:
        """Per node, ``{token: child index}``."""
        if self._children is None:
            kids: list[dict[int, int]] = [{} for _ in self.tokens]
            for i, (p, t) in enumerate(zip(self.parents[1:], self.tokens[1:]), 1):
                kids[p][t] = i
            self._children = kids
        return self._children

    def ancestors(self) -> np.ndarray:
        """Bool ``[size, size]``: ``[i, j]`` is True iff j is an ancestor of i or i itself
        (numpy: every node follows its parent pointer once per depth level)."""
        if self._ancestors is None:
            n = self.size
            up = np.asarray(self.parents, dtype=np.int64)
            up[0] = 0
            rows = np.arange(n)
            anc = np.zeros((n, n), dtype=bool)
            anc[rows, rows] = True
            cur = rows
            for _ in range(max(self.depths)):
                cur = up[cur]
                anc[rows, cur] = True
            self._ancestors = anc
        return self._ancestors


def _make(tokens: list[int], depths: list[int], parents: list[int]) -> DraftTree:
    chain = all(parents[i] == i - 1 for i in range(1, len(tokens)))
    return DraftTree(tokens, depths, parents, chain)


def tree_from_arrays(root_token: int, tokens, depths, parents) -> DraftTree:
    """The tree of draft nodes given as arrays ``[n]`` (numpy / anything ``np.asarray`` takes):
    tokens, depths (1-based) and parents (0 = the root, else the parent's 1-based index, smaller
    than the node's), node i+1 being entry i; no heap, no per-node Python work beyond ``tolist``."""
    parents = np.asarray(parents, dtype=np.int64)
    n = len(parents)
    chain = bool((parents == np.arange(n)).all())
    return DraftTree([int(root_token)] + np.asarray(tokens, dtype=np.int64).tolist(),
                     [0] + np.asarray(depths, dtype=np.int64).tolist(), [-1] + parents.tolist(), chain)


def prefix(tree: DraftTree, n: int) -> DraftTree:
    """The tree of the first ``n >= 1`` nodes of ``tree`` (every parent precedes its children, so
    they form a tree with the same root)."""
    return _make(tree.tokens[:n], tree.depths[:n], tree.parents[:n])


def root_only(root_token: int) -> DraftTree:
    """The tree with just the root (budget 0)."""
    return _make([int(root_token)], [0], [-1])


def chain_tree(root_token: int, draft_tokens: Sequence[int]) -> DraftTree:
    """A single path root -> draft_tokens[0] -> draft_tokens[1] ... (DFlash's linear block)."""
    toks = [int(root_token)] + [int(t) for t in draft_tokens]
    return _make(toks, list(range(len(toks))), list(range(-1, len(toks) - 1)))


def _rows(table, kind) -> list:
    """Nested Python lists of ``kind`` (float / int) of a 2-D table; numpy arrays / tensors convert
    in one C call (their ``tolist`` already yields Python floats / ints), other sequences item by item."""
    if hasattr(table, "tolist"):
        rows = table.tolist()
        if not rows or not rows[0] or type(rows[0][0]) is kind:
            return rows
        table = rows
    return [[kind(x) for x in row] for row in table]


def best_first(topk_logp: list[list[float]], topk_ids: list[list[int]], k: int
               ) -> Iterator[tuple[float, int, int, int]]:
    """Draft nodes in decreasing cumulative log-probability (ties: the rank tuple), without end:
    ``(score, parent, depth, token)``; the i-th item is node i (1-based; the root is node 0), so a
    parent always comes before its children. Only ranks ``< k`` of each row are used. Every
    prefix-closed consumer (one tree, or the global budget over several trees) pops from here."""
    depth_max = len(topk_logp)
    if depth_max == 0 or k <= 0 or not topk_logp[0]:
        return
    k = min(k, len(topk_logp[0]))
    # entry: (-score, rank tuple, parent index, depth, rank, score)
    heap = [(-topk_logp[0][0], (0,), 0, 1, 0, topk_logp[0][0])]
    node = 0
    while heap:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        node += 1
        yield score, parent, depth, topk_ids[depth - 1][rank]
        row = topk_logp[depth - 1]
        if rank + 1 < k:
            sib = score - row[rank] + row[rank + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sib))
        if depth < depth_max:
            child = score + topk_logp[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0, child))


def topk_rows(topk_logp, topk_ids) -> tuple[list[list[float]], list[list[int]]]:
    """The two top-K tables as nested Python lists (float / int). Raises ValueError on a shape mismatch."""
    logp, ids = _rows(topk_logp, float), _rows(topk_ids, int)
    if [len(r) for r in logp] != [len(r) for r in ids]:
        raise ValueError("topk_logp and topk_ids must have the same shape")
    return logp, ids


def build_ddtree(root_token: int, topk_logp: Sequence[Sequence[float]],
                 topk_ids: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """Best-first DDTree (Algorithm 1) with at most ``budget`` draft nodes.

    Args:
        root_token: the bonus token at the root.
        topk_logp: ``[L, K]`` log-probs of the per-position top-K draft tokens, each row sorted
            in decreasing order (``log_softmax`` of the RAW draft logits, no temperature).
            Row d-1 belongs to depth d (draft position s + d).
        topk_ids: ``[L, K]`` the matching token ids (unique within a row).
        budget: maximum number of draft nodes (root excluded); <= 0 gives the root only.
    Returns:
        DraftTree with ``min(budget, L*K)`` draft nodes (the first ``budget`` of ``best_first``); depth <= L.
    Raises:
        ValueError: the two tables differ in shape.
    """
    logp, ids = topk_rows(topk_logp, topk_ids)
    if budget <= 0:
        return root_only(root_token)
    return tree_of(root_token, itertools.islice(best_first(logp, ids, budget), budget))


def tree_of(root_token: int, nodes: Iterable[tuple[float, int, int, int]]) -> DraftTree:
    """The tree of a prefix of ``best_first``'s items (``(score, parent, depth, token)``, in order)."""
    tokens, depths, parents = [int(root_token)], [0], [-1]
    for _, parent, depth, token in nodes:
        tokens.append(int(token))
        depths.append(depth)
        parents.append(parent)
    return _make(tokens, depths, parents)
