"""Best-first DDTrees of many requests built at once with tensor operations on the device: fixed
shapes (padded to the largest node cap), no host synchronisation inside (so it can live inside a
CUDA graph). The batch engine builds every ``ddtree`` request's tree of a round here
(``draft_trees``: one log_softmax + top-K for all, one build, ONE packed device-to-host copy).

Source: Ringel & Romano, "DDTree" (arXiv 2604.12989) §3-§4: the optimal tree of B draft nodes is
the set of the B most probable prefixes under Q(y_1:L) = prod_i q_i(y_i), with only the
per-depth top-K tokens. Instead of a heap, a beam per depth: every prefix in the global top B at
depth d has its parent in the top B at depth d-1 (a child never scores above its parent, since
log-probs are <= 0, nor above its elder sibling), so keeping the best C prefixes per depth (C x K
candidates, one ``topk`` for all requests; C = the largest cap) and then sorting all depths'
prefixes by score gives, for every request, the same first ``cap`` prefixes as Algorithm 1 when
scores are distinct. On exact ties the choice among tied prefixes may differ from the heap's.

Nodes are numbered in that score order (as the heap's pop order, up to ties). The sort is stable
over a depth-major layout, so a parent tied with its child (a log-prob of exactly 0) comes first:
every prefix of the order is prefix-closed and a node's index is larger than its parent's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.speculative.tree import DraftTree, root_only, tree_from_arrays


def build_trees_device(topk_logp: Tensor, topk_ids: Tensor, width: int
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The best ``width`` draft nodes of every request, in best-first order; request i's tree of
    ``cap_i <= width`` nodes is the first ``min(cap_i, counts[i])`` of them.

    Args:
        topk_logp: ``[b, L, K]`` log-probs (any float dtype; the scores are summed in it), each row
            sorted in decreasing order (``log_softmax`` of the RAW draft logits).
        topk_ids: ``[b, L, K]`` the matching token ids (unique within a row).
        width: C >= 1, the largest cap of the batch.
    Returns:
        tokens ``[b, C]``, depths ``[b, C]`` (1-based), parents ``[b, C]`` (0 = the root, else the
        1-based index of the parent node), all long; counts ``[b]`` (long): how many prefixes exist
        (``min(C, sum_d K^d)`` unless some log-prob is -inf). Entries past ``counts[i]`` are padding.
    Raises:
        ValueError: tables of different or non-3-D shapes, or width < 1.
    """
    if topk_logp.shape != topk_ids.shape or topk_logp.dim() != 3:
        raise ValueError(f"tables must both be [b, L, K], got {tuple(topk_logp.shape)} and {tuple(topk_ids.shape)}")
    b, depth_max, k = topk_logp.shape
    c = int(width)
    if c < 1:
        raise ValueError(f"width must be >= 1, got {c}")
    dev, logp = topk_logp.device, topk_logp
    first = min(c, k)
    # the beam: per depth, the best C prefixes (scores) and each one's flat index parent_slot * K + rank
    top = logp[:, 0, :first]
    tops = [torch.nn.functional.pad(top, (0, c - first), value=float("-inf")) if first < c else top]
    idxs = [torch.arange(c, device=dev).expand(b, c)]   # depth 1: parent slot 0, rank = slot
    for d in range(1, depth_max):
        top, idx = (tops[-1][:, :, None] + logp[:, d, None, :]).reshape(b, c * k).topk(c, dim=1)
        tops.append(top)
        idxs.append(idx)
    flat = torch.stack(tops, dim=1).reshape(b, depth_max * c)
    order = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :c]   # [b, C] flat (d, slot)
    counts = torch.isfinite(flat).sum(dim=1).clamp(max=c)
    depth0 = order // c
    beam = torch.stack(idxs, dim=1).reshape(b, depth_max * c).gather(1, order)
    tokens = topk_ids.reshape(b, -1).gather(1, depth0 * k + beam % k).long()
    index = torch.zeros((b, depth_max * c), dtype=torch.long, device=dev)   # flat (d, slot) -> node
    index.scatter_(1, order, torch.arange(1, c + 1, device=dev).expand(b, c))
    parents = index.gather(1, ((depth0 - 1) * c + beam // k).clamp(min=0))
    parents = torch.where(depth0 > 0, parents, 0)
    return tokens, depth0 + 1, parents, counts


def draft_trees(draft_logits: Tensor, roots: list[int], caps: list[int]) -> list[DraftTree]:
    """Every request's best-first DDTree from draft logits ``[b, L, vocab]``: one log_softmax
    (fp32, raw logits) + top-K (K = min(max cap, vocab)) and one build for all, ONE packed
    device-to-host copy, then host trees without a heap. ``caps[i]``: request i's most draft
    nodes (min(tree budget, room)); <= 0 gives its root alone."""
    width = max(caps, default=0)
    if width <= 0:
        return [root_only(r) for r in roots]
    vals, ids = topk_logp(draft_logits, width)
    tokens, depths, parents, counts = build_trees_device(vals, ids, width)
    host = torch.cat((tokens, depths, parents, counts[:, None]), dim=1).cpu().numpy()
    out = []
    for i, (root, cap) in enumerate(zip(roots, caps)):
        n = min(int(cap), int(host[i, -1])) if cap > 0 else 0
        row = host[i]
        out.append(tree_from_arrays(root, row[:n], row[width:width + n], row[2 * width:2 * width + n]))
    return out


# fp32 log_softmax rows of one pass: a batch's draft logits at a large vocabulary would otherwise
# take 2 x 4 x rows x vocab bytes at once (150 requests x 15 rows of the 248,320-token Qwen3.6
# vocabulary: 4.4 GB), more than a full server has left
CHUNK_BYTES = 256 << 20


def topk_logp(draft_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-K (K = min(k, vocab)) of ``log_softmax`` (fp32, raw logits) over the last axis of
    ``[..., L, vocab]``: on an accelerator in passes of at most ``CHUNK_BYTES`` of fp32 rows (one
    pass for a request or a small batch); request by request on the CPU, where the batch's whole
    fp32 log_softmax would not stay in the caches. Row-wise, so the values are the same either way."""
    k = min(k, draft_logits.shape[-1])
    if draft_logits.device.type == "cpu" and draft_logits.dim() >= 3:
        parts = [torch.log_softmax(x.float(), dim=-1).topk(k, dim=-1) for x in draft_logits]
        return torch.stack([v for v, _ in parts]), torch.stack([i for _, i in parts])
    return topk_rows_chunked(draft_logits, k, max(1, CHUNK_BYTES // (4 * draft_logits.shape[-1])))


def topk_rows_chunked(draft_logits: Tensor, k: int, step: int) -> tuple[Tensor, Tensor]:
    """``topk_logp`` in passes of ``step`` rows of the flattened ``[..., vocab]`` logits."""
    rows = draft_logits.reshape(-1, draft_logits.shape[-1])
    if rows.shape[0] <= step:
        return torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)
    vals = torch.empty((rows.shape[0], k), dtype=torch.float32, device=rows.device)
    ids = torch.empty((rows.shape[0], k), dtype=torch.long, device=rows.device)
    for i in range(0, rows.shape[0], step):
        v, ix = torch.log_softmax(rows[i:i + step].float(), dim=-1).topk(k, dim=-1)
        vals[i:i + step], ids[i:i + step] = v, ix
    shape = (*draft_logits.shape[:-1], k)
    return vals.view(shape), ids.view(shape)


def build_ddtree_device(topk_logp: Tensor, topk_ids: Tensor, root: Tensor | int, budget: int
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One request's tree of exactly ``budget`` draft nodes (+ root) from ``[L, K]`` tables on any
    device (``build_trees_device`` with b = 1).

    Returns:
        tokens ``[B+1]`` (long), depths ``[B+1]`` (long, root 0), parents ``[B+1]`` (long, root -1),
        ancestor mask ``[B+1, B+1]`` (bool, True where column j is an ancestor-or-self of row i).
    Raises:
        ValueError: tables of different shapes, or fewer than B prefixes exist.
    """
    if topk_logp.shape != topk_ids.shape or topk_logp.dim() != 2:
        raise ValueError(f"tables must both be [L, K], got {tuple(topk_logp.shape)} and {tuple(topk_ids.shape)}")
    depth_max, k = topk_logp.shape
    b = int(budget)
    if b < 1 or sum(k ** d for d in range(1, depth_max + 1)) < b:
        raise ValueError(f"budget {b} needs at least {b} prefixes; an [{depth_max}, {k}] table has fewer")
    dev = topk_logp.device
    tokens, depths, parents, _ = build_trees_device(topk_logp.float()[None], topk_ids[None], b)
    if isinstance(root, torch.Tensor):
        root_t = root.to(device=dev, dtype=torch.long).reshape(1)
    else:  # a fill kernel, not a host-to-device copy (allowed while a CUDA graph is captured)
        root_t = torch.full((1,), int(root), dtype=torch.long, device=dev)
    tokens = torch.cat((root_t, tokens[0]))
    depths = torch.cat((torch.zeros(1, dtype=torch.long, device=dev), depths[0]))
    parents = torch.cat((torch.full((1,), -1, dtype=torch.long, device=dev), parents[0]))
    return tokens, depths, parents, ancestor_mask(parents, depth_max)


def ancestor_mask(parents: Tensor, depth_max: int) -> Tensor:
    """Bool ``[n, n]`` ancestor-or-self mask from parents ``[n]`` (root's parent -1) of trees at
    most ``depth_max`` deep, by pointer doubling (fixed work, no data-dependent loop): the rows
    cover ancestors up to 2^t steps away after t rounds of ``mask |= mask[jump]; jump = jump[jump]``."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    if depth_max <= 0:
        return mask
    jump = parents.clamp(min=0)  # node 0 (the root) points to itself
    mask.scatter_(1, jump[:, None], True)   # self and parent
    for _ in range(max(depth_max - 1, 0).bit_length()):
        mask = mask | mask.index_select(0, jump)
        jump = jump[jump]
    return mask


def device_tree_inputs(draft_logits: Tensor, root: Tensor | int, budget: int, start: Tensor | int
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Verify inputs straight from draft logits ``[L, vocab]`` on the device: log_softmax (fp32),
    top-K (K = min(budget, vocab)), ``build_ddtree_device``; returns ids ``[B+1]``, positions
    ``[B+1]`` (start + depth) and the ancestor mask ``[B+1, B+1]``, as ``decode.tree_inputs``."""
    k = min(budget, draft_logits.shape[-1])
    vals, ids = torch.log_softmax(draft_logits.float(), dim=-1).topk(k, dim=-1)
    tokens, depths, _, mask = build_ddtree_device(vals, ids, root, budget)
    return tokens, depths + start, mask
