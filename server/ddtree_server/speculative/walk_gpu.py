"""The acceptance walk of many verified draft trees at once on the device (the rows of a batched
round, request after request), fixed work and ONE packed device-to-host copy; equal to
``walk.walk`` per tree.

Parent-compare form: a node is on the accepted path iff every node on its root path (itself
included, the root excepted) carries the target's choice at its parent. Pointer doubling settles
it in ceil(log2(depth_max)) rounds of ``acc &= acc[jump]; jump = jump[jump]`` (jump: the 2^t-th
ancestor, a root its own), not depth_max rounds of one step each; the path's last node (accepted, no accepted
child) gives the bonus: the target's choice there. Node indices grow from parent to child, so a
tree's accepted nodes in index order are its path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def walk_rows(choices: Tensor, tokens: Tensor, parents: Tensor, depth_max: int) -> Tensor:
    """Accepted rows and bonus tokens of every tree of a batch, on the device.

    Args:
        choices: ``[N]`` the target's token per row (long).
        tokens: ``[N]`` each row's draft token (long; a root's is not read).
        parents: ``[N]`` each row's parent row in the same flat numbering, -1 for a root (long).
        depth_max: the deepest node's depth over all trees.
    Returns:
        ``[2, N]`` long: row 0 is 1 on the accepted path's rows, row 1 the bonus token on each
        tree's last path row and -1 elsewhere.
    """
    root = parents < 0
    up = torch.where(root, torch.arange(parents.shape[0], device=parents.device), parents)   # a root: itself
    acc = root | (tokens == choices[up])   # the node's own edge carries its parent's choice
    jump = up
    for _ in range(max(depth_max - 1, 0).bit_length()):   # pointer doubling: after t rounds, 2^t path nodes
        acc = acc & acc[jump]
        jump = jump[jump]
    kids = torch.zeros_like(up).scatter_add_(0, up, (acc & ~root).long())
    leaf = acc & (kids == 0)
    return torch.stack((acc.long(), torch.where(leaf, choices, -1)))


def walk_all(choices: Tensor, trees: list, offsets: list[int], staging=None) -> list[tuple[list[int], int]]:
    """``walk.walk`` of every tree, whose rows start at ``offsets[i]`` (ascending) of ``choices``
    (``[N]``, long, on the device; rows of no tree are padding): one host-to-device copy (tokens,
    parent rows; through ``staging.send`` when given: a pinned buffer, engine/decode.py),
    ``walk_rows``, one copy back. Returns per tree (path, bonus) as ``walk.walk``."""
    n = choices.shape[0]
    host = np.full((2, n), -1, dtype=np.int64)
    live = np.zeros(n, dtype=bool)
    for t, a in zip(trees, offsets):
        host[0, a:a + t.size] = t.tokens
        par = np.asarray(t.parents, dtype=np.int64)
        host[1, a:a + t.size] = np.where(par < 0, -1, par + a)
        live[a:a + t.size] = True
    dev = staging.send(host, choices.device) if staging is not None else torch.from_numpy(host).to(choices.device)
    acc, bonus = walk_rows(choices, dev[0], dev[1], max((max(t.depths) for t in trees), default=0)).cpu().numpy()
    rows = np.flatnonzero((acc == 1) & live)
    tree_of = np.searchsorted(np.asarray(offsets), rows, side="right") - 1
    counts = np.bincount(tree_of, minlength=len(trees))
    paths = np.split(rows - np.asarray(offsets)[tree_of], np.cumsum(counts)[:-1])
    bonuses = bonus[np.flatnonzero((bonus >= 0) & live)].tolist()
    return [(p.tolist(), b) for p, b in zip(paths, bonuses)]
