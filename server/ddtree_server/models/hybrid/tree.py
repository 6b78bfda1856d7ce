"""Per-forward tree metadata shared by every GDN layer (built ONCE per forward, on the device).

From the block's ancestor-or-self mask (bool ``[n, n]``, topological order: an ancestor has a
smaller index) or a plain causal chain (mask None):

* ``anc``: the mask itself (``tril`` for a chain), used by the tree-masked delta rule;
* ``parent``: long ``[n]``, the nearest proper ancestor, -1 for a root (the largest index j < i
  with ``anc[i, j]``): used by the per-node method;
* ``win``: long ``[n, K]``, the K rows of node i's causal-conv window: rows 0..K-2 are the
  committed conv state (oldest first), row K-1+i is node i's input (the projection's row i; the
  verify scratch's ``inputs`` row i, after the block's base, for the commit). The window follows the node's own ancestors, then continues into the committed state
  (never a sibling's input); its last K-1 entries are the conv state to commit if node i is the
  accepted one. For a chain, ``win[i] = [i, i+1, ..., i+K-1]``.

No host synchronisation: everything is tensor arithmetic, so it also runs inside CUDA graphs
(where the mask is a static buffer rewritten before every replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TreeMeta:
    """See the module docstring."""

    anc: Tensor
    parent: Tensor
    win: Tensor
    chain: bool


def tree_meta(block: Tensor | None, n: int, kernel: int, device) -> TreeMeta:
    """Metadata of ``n`` new rows; ``block`` bool ``[n, n]`` ancestor-or-self mask or None (chain)."""
    idx = torch.arange(n, device=device)
    if block is None:
        anc = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        win = idx[:, None] + torch.arange(kernel, device=device)[None, :]
        return TreeMeta(anc, idx - 1, win, True)
    strict = block & (idx[None, :] < idx[:, None])
    parent = (strict.long() * (idx + 1)).amax(dim=1) - 1
    k1 = kernel - 1
    state_rows = (torch.arange(k1, device=device) - 1).clamp_(min=0)
    node_rows = torch.where(parent >= 0, parent + k1, torch.full_like(parent, k1 - 1))
    up = torch.cat((state_rows, node_rows))  # row -> the row one step back in the window
    cols = [idx + k1]
    for _ in range(k1):
        cols.append(up[cols[-1]])
    win = torch.stack(cols[::-1], dim=1)
    return TreeMeta(block, parent, win, False)
