"""The draft trees of a decode round: their kinds and the round's counts (``RoundInfo``), and the
trees of the requests that choose their own (not governed by the speculation policy,
``--spec-policy fixed``): ``ddtree`` requests get best-first trees, all of the round's at once from
ONE device build and ONE packed device-to-host copy (speculative/tree_gpu.py ``draft_trees``; or
each from the host heap, the batch-1 path); ``dflash`` requests the chain of their draft argmaxes;
a cap of 0 gives the root alone. ``round_trees``: every request's tree of a round, the speculation
policy's plan for the requests it governs (one global node budget) and the own trees above for
the others, cut to the rows the round may verify (``fit_rows``: a hybrid's verify scratch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from ddtree_server.engine import decode
from ddtree_server.speculative.tree import DraftTree, chain_tree, prefix, root_only
from ddtree_server.speculative.tree_gpu import draft_trees

KINDS = ("plain", "chain", "tree")


@dataclass
class RoundInfo:
    """The last decode round: draft nodes verified over all requests (N), requests per tree kind
    (plain = the root alone, chain, tree) and the policy's expected accepted draft tokens."""

    nodes: int = 0
    kinds: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    expected: float | None = None


def kind_of(tree: DraftTree) -> str:
    return "plain" if tree.size == 1 else "chain" if tree.is_chain else "tree"


def one_tree(req, draft: Tensor | None, chain: list[int] | None, cap: int) -> DraftTree:
    """One request's tree from its draft logits ``[L, vocab]`` (or its argmax chain), host-built."""
    if req.mode == "ar" or cap <= 0:
        return root_only(req.bonus)
    if req.mode == "dflash":
        return chain_tree(req.bonus, chain[:cap]) if chain is not None else \
            decode.dflash_builder(draft, req.bonus, cap)
    return decode.ddtree_builder(draft, req.bonus, cap)


def own_trees(reqs: list, rows: list[int], logits: Tensor, chains: list | None, caps: list[int],
              device: bool = True) -> list[DraftTree]:
    """The trees of ``reqs``: request i's draft logits are ``logits[rows[i]]`` (``[L, vocab]``), its
    argmax chain ``chains[rows[i]]``, its most draft nodes ``caps[i]`` (min(tree budget, room)).
    ``device``: the ddtree trees from the batched device builder, else from the host heap."""
    trees: list[DraftTree | None] = [None] * len(reqs)
    batch = [i for i, r in enumerate(reqs) if r.mode == "ddtree" and caps[i] > 0] if device else []
    if batch:
        sel = [rows[i] for i in batch]
        built = draft_trees(logits if sel == list(range(logits.shape[0])) else logits[sel],
                            [reqs[i].bonus for i in batch], [caps[i] for i in batch])
        for i, tree in zip(batch, built):
            trees[i] = tree
    return [t if t is not None else one_tree(r, logits[rows[i]], None if chains is None else chains[rows[i]], caps[i])
            for i, (r, t) in enumerate(zip(reqs, trees))]


def fit_rows(trees: list[DraftTree], cap: int | None, total: int | None) -> list[DraftTree]:
    """The trees cut to at most ``cap`` rows each and ``total`` rows together (None: no bound),
    each to the prefix of its nodes (parents precede children, so a prefix with the root is a
    draft tree: verification stays exact, only fewer draft tokens can be accepted). Over
    ``total``, every tree gets the same share of nodes (water-filling: the smaller trees keep
    theirs), the rows left over one more node each in request order; when the roots alone exceed
    ``total`` (more requests than rows), every tree is its root (a plain round pends nothing)."""
    sizes = [min(t.size, cap) if cap is not None else t.size for t in trees]
    if total is not None and sum(sizes) > total:
        if len(sizes) >= total:
            sizes = [1] * len(sizes)
        else:
            share = max(s for s in range(1, max(sizes) + 1) if sum(min(n, s) for n in sizes) <= total)
            left = total - sum(min(n, share) for n in sizes)
            cut = []
            for n in sizes:
                extra = 1 if n > share and left > 0 else 0
                left -= extra
                cut.append(min(n, share) + extra)
            sizes = cut
    return [t if n == t.size else prefix(t, n) for t, n in zip(trees, sizes)]


def round_trees(reqs: list, drafted: list, logits: Tensor | None, chains: list | None, room, policy,
                info: RoundInfo, device: bool = True, rows: tuple[int | None, int | None] = (None, None)
                ) -> list[DraftTree]:
    """Every request's tree of a round: the policy's plan for the governed drafted ones (one global
    node budget), the request's own mode for the others, the root alone for those without a draft.
    ``room(req)``: the draft nodes its cache can still take; ``policy``: the SpecPolicy or None;
    ``info``: the round's counts, updated here. ``device``: the ddtree trees come from the batched
    device builder (else the host heap). ``rows``: (rows per tree, rows of the round) for
    ``fit_rows``."""
    governed = (lambda r: r.governed) if policy is not None else (lambda r: False)
    row = {id(r): i for i, r in enumerate(drafted)}
    own = [r for r in drafted if not governed(r)]
    out = dict(zip(map(id, own), own_trees(own, [row[id(r)] for r in own], logits, chains,
                                           [min(r.budget, room(r)) for r in own], device)))
    gov = [r for r in drafted if governed(r)]
    if gov:
        caps = [max(min(r.budget, room(r)), 0) for r in gov]
        idx = [row[id(r)] for r in gov]
        logp, ids = decode.topk_tables(logits[idx] if len(idx) < len(drafted) else logits, max(max(caps), 1))
        plan = policy.plan(len(reqs), sum(t.size - 1 for t in out.values()), len(drafted),
                           list(zip(logp.tolist(), ids.tolist())), caps, [r.bonus for r in gov], gov)
        out.update(zip(map(id, gov), plan.trees))
        info.expected = plan.expected
    trees = fit_rows([out[id(r)] if id(r) in out else root_only(r.bonus) for r in reqs], *rows)
    for t in trees:
        info.nodes += t.size - 1
        info.kinds[kind_of(t)] += 1
    return trees
