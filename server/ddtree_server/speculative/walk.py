"""Pure acceptance walk over a verified draft tree (CPU only).

Source: DDTree (arXiv 2604.12989) verification; docs/ddtree.md §2.1 step 5 and §2.4. The target has
produced one chosen token per tree node (``choices[i]`` = the target's token AFTER node i's
prefix): the argmax at temperature 0, or an independent draw from the processed target
distribution at T > 0 ("sample-and-match"). Starting at the root, the walk moves to the child
whose token equals the choice and stops at the first choice that is not a child; that choice is
the bonus token. Every emitted token is the target's own choice given its prefix, so greedy
output equals plain greedy decoding and sampled output has exactly the target's distribution.
"""

from __future__ import annotations

from typing import Sequence

from ddtree_server.speculative.tree import DraftTree


def walk(tree: DraftTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """Accepted path and bonus token.

    Args:
        tree: the verified DraftTree.
        choices: ``[tree.size]`` target-chosen token per node (only path entries are read).
    Returns:
        (path, bonus): node indices root first (``path[0] == 0``, strictly increasing) and the
        bonus token. ``len(path)`` tokens are gained this round: the accepted draft tokens
        ``tree.tokens[path[1:]]`` plus the bonus.
    Raises:
        ValueError: ``len(choices) != tree.size``.
    """
    if len(choices) != tree.size:
        raise ValueError(f"{len(choices)} choices for a tree of {tree.size} nodes")
    node = 0
    path = [0]
    while True:
        token = int(choices[node])
        child = tree.children[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def accepted_tokens(tree: DraftTree, path: Sequence[int], bonus: int) -> list[int]:
    """The tokens a round emits: accepted draft tokens (root excluded) then the bonus."""
    return [tree.tokens[i] for i in path[1:]] + [int(bonus)]
