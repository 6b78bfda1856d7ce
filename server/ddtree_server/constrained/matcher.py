"""Grammar masks over a verified draft tree, for one request (docs/constrained.md, "Exactness").

The committed state is an xgrammar ``GrammarMatcher`` that has accepted every emitted token. For
a tree (node 0 = the root, already emitted; node i > 0 carries token ``tokens[i]`` under
``parents[i] < i``) the mask of node i is the grammar's next-token mask after the root path
of i, so the target's choice at every node is its constrained choice given that node's prefix, as
in plain constrained decoding. xgrammar's ``traverse_draft_tree`` walks the tree depth first from
the committed state: a node whose token its parent's mask refuses is skipped with its subtree
(no constrained walk can reach it); an accepted node is matched, its mask filled, its children
visited, and the token rolled back, so the committed state is the same afterwards (the same walk
as SGLang's ``traverse_tree`` for EAGLE trees). Rows of nodes no constrained path reaches come out
empty; they are left unmasked, so sampling never sees a row without any allowed token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor


def child_sibling(parents: Sequence[int]) -> tuple[Tensor, Tensor]:
    """First-child and next-sibling arrays (int64, -1 = none) of a tree given by ``parents``
    (``parents[0] == -1``, ``parents[i] < i``): xgrammar's / SGLang's tree encoding."""
    n = len(parents)
    first = np.full(n, -1, dtype=np.int64)
    sibling = np.full(n, -1, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        p = parents[i]
        if last[p] < 0:
            first[p] = i
        else:
            sibling[last[p]] = i
        last[p] = i
    return torch.from_numpy(first), torch.from_numpy(sibling)


class TreeMatcher:
    """Per-request grammar state: ``masks`` for a tree, ``commit`` for emitted tokens.

    Args:
        grammar: a ``constrained.compiler.Grammar``; vocab_size: logits columns.
    """

    def __init__(self, grammar, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.vocab_size = int(vocab_size)
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.refused = 0     # committed tokens the grammar did not accept (never expected)

    @property
    def terminated(self) -> bool:
        """True once the grammar has accepted a stop token (nothing further is allowed)."""
        return self.matcher.is_terminated()

    def masks(self, parents: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """int32 bitmask ``[n, ceil(V / 32)]`` (CPU) of the n tree nodes; a row with no allowed
        token (unreachable node, finished grammar) is all ones (no constraint)."""
        n = len(parents)
        if self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(max(n, 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[:n]
        bitmask.fill_(-1)
        if self.terminated:
            return bitmask
        first, sibling = child_sibling(parents)
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        self.matcher.traverse_draft_tree(first, sibling, ids, bitmask)
        empty = (bitmask == 0).all(dim=1)
        if bool(empty.any()):
            bitmask[empty] = -1
        return bitmask

    def apply(self, logits: Tensor, bitmask: Tensor) -> None:
        """Masked columns of ``logits [n, V]`` become -inf, in place (on the logits' device)."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the committed state by emitted tokens (ignored once terminated)."""
        for tok in tokens:
            if self.terminated:
                return
            if not self.matcher.accept_token(int(tok)):
                self.refused += 1
