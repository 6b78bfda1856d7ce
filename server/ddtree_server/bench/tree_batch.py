"""Host side of a batched DDTree round, before vs after the batched device builder: per round, the
trees of b requests built one request at a time (``decode.ddtree_builder``: log_softmax + top-K +
a device-to-host copy + the heap, each) vs ONE device build (``tree_gpu.draft_trees``), and the
acceptance walks (the choices to the host + ``walk`` per tree vs ``walk_gpu.walk_all``). Random
draft logits ``[b, 15, vocab]`` (bf16 on CUDA), the ancestor masks included (the forward needs them).

``python -m ddtree_server.bench.tree_batch [--batch 1,8,32,64] [--budgets 16,64] [--vocab 49152]
[--iters 20] [--out FILE.json]``: a markdown table on stdout (ms per round, device synchronised
around each call), the rows as JSON in ``--out``. Each row also checks the device results: the
walks equal ``walk`` per tree (``walks_equal``), and how many requests' trees have the heap's node
set (``same_trees``; bf16 logits have exact ties, where either choice is a best tree).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _paths(tree) -> set:
    """A tree's node set as token paths from the root."""
    path = {0: ()}
    for i in range(1, tree.size):
        path[i] = path[tree.parents[i]] + (tree.tokens[i],)
    return set(path.values())


def measure(batches, budgets, vocab: int, iters: int, device) -> list[dict]:
    import torch

    from ddtree_server.bench.timing import time_calls
    from ddtree_server.engine import decode
    from ddtree_server.speculative.tree_gpu import draft_trees
    from ddtree_server.speculative.walk import walk
    from ddtree_server.speculative.walk_gpu import walk_all

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    rows = []
    for budget in budgets:
        for b in batches:
            g = torch.Generator().manual_seed(b)
            logits = (torch.randn(b, 15, vocab, generator=g) * 4).to(device=device, dtype=dtype)
            trees = [decode.ddtree_builder(logits[i], 7, budget) for i in range(b)]
            offsets = [sum(t.size for t in trees[:i]) for i in range(b)]
            choices = torch.tensor([t.tokens[min(i + 1, t.size - 1)] for t in trees for i in range(t.size)],
                                   device=device)

            def walks_before():
                got = choices.tolist()
                for t, a in zip(trees, offsets):
                    t._children = None
                    walk(t, got[a:a + t.size])

            row = {"budget": budget, "batch": b,
                   "trees_before": time_calls(lambda: [decode.ddtree_builder(logits[i], 7, budget).ancestors()
                                                       for i in range(b)], iters, 3, device)["ms"],
                   "trees_after": time_calls(lambda: [t.ancestors() for t in draft_trees(logits, [7] * b, [budget] * b)],
                                             iters, 3, device)["ms"],
                   "walk_before": time_calls(walks_before, iters, 3, device)["ms"],
                   "walk_after": time_calls(lambda: walk_all(choices, trees, offsets), iters, 3, device)["ms"]}
            got = choices.tolist()
            row["walks_equal"] = walk_all(choices, trees, offsets) == [walk(t, got[a:a + t.size])
                                                                       for t, a in zip(trees, offsets)]
            row["same_trees"] = sum(_paths(x) == _paths(y) for x, y in zip(
                draft_trees(logits, [7] * b, [budget] * b), trees))
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = measure([int(x) for x in a.batch.split(",")], [int(x) for x in a.budgets.split(",")], a.vocab,
                   a.iters, device)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"device": str(device), "vocab": a.vocab, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
