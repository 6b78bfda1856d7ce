"""Best-first DDTree built with tensor operations on the device: no host round trip, fixed shapes
(so it can live inside a CUDA graph). The seed of the batched GPU tree builder: continuous batching
will build every slot's tree here in one pass. Today it is measured by the GPU probe
(the `tree` part of `bench/probe.py`) and tested against the heap; the engine still builds trees on the host
(speculative/tree.py).

Source: Ringel & Romano, "DDTree" (arXiv 2604.12989) §3-§4: the optimal tree of B draft nodes is
the set of the B most probable prefixes under Q(y_1:L) = prod_i q_i(y_i), with only the
per-depth top-K tokens. Instead of a heap, a beam per depth: every prefix in the global top B at
depth d has its parent in the top B at depth d-1 (a child never scores above its parent, since
log-probs are <= 0, nor above its elder sibling), so keeping the best B prefixes per depth (B x K
candidates, one ``topk``) and then the best B over all depths gives the same set as Algorithm 1
when scores are distinct. On exact ties the choice among tied prefixes may differ from the heap's.

Nodes are numbered depth-major (all depth-1 nodes, then depth 2, ...), so parents precede children;
the order differs from the heap's pop order, which does not matter for verification.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _finite_candidates(depths: int, k: int, width: int) -> int:
    total, level = 0, 1
    for _ in range(depths):
        level = min(width, level * k)
        total += level
    return total


def build_ddtree_device(topk_logp: Tensor, topk_ids: Tensor, root: Tensor | int, budget: int
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Tree of exactly ``budget`` draft nodes (+ root) from per-depth top-K tables on any device.

    Args:
        topk_logp: ``[L, K]`` fp32 log-probs, each row sorted in decreasing order.
        topk_ids: ``[L, K]`` long token ids of the same entries.
        root: the bonus token (int or 0-d long tensor on the same device).
        budget: B >= 1 draft nodes.
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
    if b < 1 or _finite_candidates(depth_max, k, b) < b:
        raise ValueError(f"budget {b} needs at least {b} prefixes; an [{depth_max}, {k}] table has fewer")
    dev = topk_logp.device
    logp = topk_logp.float()
    neg = torch.full((b,), float("-inf"), device=dev)
    scores = torch.empty((depth_max, b), device=dev)
    parent_slot = torch.zeros((depth_max, b), dtype=torch.long, device=dev)
    rank = torch.zeros((depth_max, b), dtype=torch.long, device=dev)
    first = min(b, k)
    scores[0] = torch.cat((logp[0, :first], neg[first:]))
    rank[0, :first] = torch.arange(first, device=dev)
    for d in range(1, depth_max):
        cand = (scores[d - 1][:, None] + logp[d][None, :]).reshape(-1)  # [B * K]
        top, idx = cand.topk(b)
        scores[d] = top
        parent_slot[d] = idx // k
        rank[d] = idx % k
    _, chosen = scores.reshape(-1).topk(b)
    chosen = chosen.sort().values                       # depth-major node order
    depth0 = chosen // b                                # 0-based depth index of each node
    slot = chosen % b
    new_index = torch.zeros(depth_max * b, dtype=torch.long, device=dev)
    new_index[chosen] = torch.arange(1, b + 1, device=dev)
    parent_flat = ((depth0 - 1).clamp(min=0) * b + parent_slot[depth0, slot])
    parents = torch.where(depth0 > 0, new_index[parent_flat], torch.zeros_like(depth0))
    if isinstance(root, torch.Tensor):
        root_t = root.to(device=dev, dtype=torch.long).reshape(1)
    else:  # a fill kernel, not a host-to-device copy (allowed while a CUDA graph is captured)
        root_t = torch.full((1,), int(root), dtype=torch.long, device=dev)
    tokens = torch.cat((root_t, topk_ids[depth0, rank[depth0, slot]].long()))
    depths = torch.cat((torch.zeros(1, dtype=torch.long, device=dev), depth0 + 1))
    parents = torch.cat((torch.full((1,), -1, dtype=torch.long, device=dev), parents))
    return tokens, depths, parents, ancestor_mask(parents, depth_max)


def ancestor_mask(parents: Tensor, depth_max: int) -> Tensor:
    """Bool ``[n, n]`` ancestor-or-self mask from parents ``[n]`` (root's parent -1), by following
    each node's parent ``depth_max`` times (fixed work, no data-dependent loop)."""
    n = parents.shape[0]
    up = parents.clamp(min=0)  # the root points to itself
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    cur = torch.arange(n, device=parents.device)
    for _ in range(depth_max):
        cur = up[cur]
        mask.scatter_(1, cur[:, None], True)
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
