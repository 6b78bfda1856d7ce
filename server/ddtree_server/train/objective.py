"""The block-diffusion training objective of DFlash drafters (ddtree.md §1.1 "training facts").

Random anchors inside each response: the anchor slot holds the clean token, the other bs-1 slots
are MASK; row k (1..bs-1) of a block predicts the token at anchor+k. Loss: cross-entropy on those
rows weighted by exp(-(k-1)/gamma) (gamma ~ 7, as in the SpecForge recipes), averaged over the
weights of valid rows. The LM head is applied in row chunks under activation checkpointing so that
[rows, vocab] logits never exist all at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def position_weights(block_size: int, gamma: float, device=None) -> Tensor:
    """[block_size-1] weights exp(-(k-1)/gamma) for in-block positions k = 1..block_size-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(prompt_lens: list[int], seq_lens: list[int], num_anchors: int,
                   generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Anchors drawn without replacement from each response: positions [prompt_len, seq_len-2]
    (the first response token can be an anchor, as the first bonus is; at least one label follows).

    Returns anchors long [B, A] (sorted per row; padding = 0) and valid bool [B, A]."""
    b = len(prompt_lens)
    anchors = torch.zeros((b, num_anchors), dtype=torch.long)
    valid = torch.zeros((b, num_anchors), dtype=torch.bool)
    for r, (p, n) in enumerate(zip(prompt_lens, seq_lens)):
        count = max(0, n - 1 - p)
        take = min(num_anchors, count)
        if take:
            pick = torch.randperm(count, generator=generator)[:take].sort().values + p
            anchors[r, :take] = pick
            valid[r, :take] = True
    return anchors, valid


def _chunk_loss(hidden: Tensor, labels: Tensor, weights: Tensor, lm_head) -> tuple[Tensor, Tensor]:
    logits = lm_head(hidden).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1) == labels


def block_loss(hidden: Tensor, input_ids: Tensor, seq_lens: Tensor, anchors: Tensor, valid: Tensor,
               weights: Tensor, lm_head, chunk_rows: int = 8192) -> tuple[Tensor, dict]:
    """Weighted CE of the drafter's block rows.

    hidden: [B, A, bs, H] from `DFlashDrafter.forward_train`; input_ids: long [B, T];
    seq_lens: long [B] (real lengths, right padding); anchors/valid: [B, A]; weights: [bs-1].
    Returns (loss scalar, stats) where stats holds 0-d / 1-d tensors (no host sync): `acc`
    (top-1 accuracy per in-block position k, [bs-1]) and `tau` (mean accepted length of greedy
    chain drafting simulated on the full-length blocks: 1 + leading run of correct top-1
    predictions; NaN without a full block). Use `stats_to_host` to turn them into numbers.
    Raises ValueError when no row has a label."""
    b, a, bs, h = hidden.shape
    t = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, bs, device=anchors.device)  # [B, A, bs-1]
    has_label = valid[:, :, None] & (pos < seq_lens[:, None, None])
    if not bool(has_label.any()):
        raise ValueError("no labelled row in this batch")
    labels = input_ids.gather(1, pos.clamp(max=t - 1).reshape(b, -1)).reshape(b, a, bs - 1)
    rows, ys = hidden[:, :, 1:][has_label], labels[has_label]
    ws = weights.expand(b, a, bs - 1)[has_label]
    total = hidden.new_zeros((), dtype=torch.float32)
    correct = []
    for i in range(0, rows.shape[0], chunk_rows):
        sl = slice(i, i + chunk_rows)
        if torch.is_grad_enabled():
            part, ok = checkpoint(_chunk_loss, rows[sl], ys[sl], ws[sl], lm_head, use_reentrant=False)
        else:
            part, ok = _chunk_loss(rows[sl], ys[sl], ws[sl], lm_head)
        total = total + part
        correct.append(ok)
    loss = total / ws.sum()
    with torch.no_grad():
        grid = torch.zeros_like(has_label)
        grid[has_label] = torch.cat(correct)
        per_k = grid.sum((0, 1)).float() / has_label.sum((0, 1)).clamp(min=1).float()
        full = has_label.all(-1).float()
        run = torch.cumprod(grid.long(), dim=-1).sum(-1).float() + 1.0
        tau = (run * full).sum() / full.sum()  # NaN when no block is full-length
    return loss, {"acc": per_k, "tau": tau}


def stats_to_host(stats: dict) -> dict:
    """{"acc": [floats], "tau": float or None} from `block_loss` stats (one host sync)."""
    acc = [round(float(x), 4) for x in stats["acc"].tolist()]
    tau = float(stats["tau"])
    return {"acc": acc, "tau": None if math.isnan(tau) else round(tau, 4)}
