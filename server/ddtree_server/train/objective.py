"""The block-diffusion training objective of DFlash drafters.

Source: DFlash (arXiv 2602.06036) and SpecForge's DFlash trainer; docs/ddtree.md §1.1.

Random anchors inside each response: the anchor slot holds the clean token, the other bs-1 slots
are MASK; row k (1..bs-1) of a block predicts the token at anchor+k. Loss: cross-entropy on those
rows weighted by exp(-(k-1)/gamma) (gamma ~ 7, as in the SpecForge recipes), averaged over the
weights of valid rows. The LM head is applied in row chunks under activation checkpointing so that
[rows, vocab] logits never exist all at once.

Row sampling (optional): the 49,152-wide LM head over every block row is the largest cost of a
training step. With `row_sample`, row k is kept with probability w_k / w_1 and weighted w_1
instead of w_k, an unbiased estimate of the same weighted loss (importance sampling) that runs the
LM head on sum(w)/(bs-1) of the rows (44% for bs 16, gamma 7). The drafter's own layers still
run on every row (the block's rows attend to each other).
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
               weights: Tensor, lm_head, chunk_rows: int = 8192,
               row_sample: torch.Generator | None = None) -> tuple[Tensor, dict]:
    """Weighted CE of the drafter's block rows.

    hidden: [B, A, bs, H] from `DFlashDrafter.forward_train`; input_ids: long [B, T];
    seq_lens: long [B] (real lengths, right padding); anchors/valid: [B, A]; weights: [bs-1].
    row_sample: a CPU generator to sample rows (see the module docstring); None = every row.
    Returns (loss scalar, stats) where stats holds 0-d / 1-d tensors (no host sync): `acc`
    (top-1 accuracy per in-block position k, [bs-1]), `accept` (share of full-length blocks whose
    leading run of correct top-1 predictions reaches position k, [bs-1]: greedy chain drafting
    simulated on the block) and `tau` (1 + the mean leading run = 1 + sum(accept); NaN without a
    full block). With row sampling, acc covers the kept rows and accept / tau are NaN. Use
    `stats_to_host` to turn them into numbers. Raises ValueError when no row has a label."""
    b, a, bs, h = hidden.shape
    t = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, bs, device=anchors.device)  # [B, A, bs-1]
    has_label = valid[:, :, None] & (pos < seq_lens[:, None, None])
    if not bool(has_label.any()):
        raise ValueError("no labelled row in this batch")
    labels = input_ids.gather(1, pos.clamp(max=t - 1).reshape(b, -1)).reshape(b, a, bs - 1)
    norm = weights.expand(b, a, bs - 1)[has_label].sum()
    use = has_label
    w_rows = weights.expand(b, a, bs - 1)
    if row_sample is not None:
        keep_p = (weights / weights.max()).cpu()
        draw = torch.rand((b, a, bs - 1), generator=row_sample) < keep_p
        use = has_label & draw.to(has_label.device)
        w_rows = torch.full_like(w_rows, float(weights.max()))
    rows, ys, ws = hidden[:, :, 1:][use], labels[use], w_rows[use]
    total = hidden[:, :, :1].sum().float() * 0.0  # keeps a graph even if no row is kept
    correct = []
    for i in range(0, rows.shape[0], chunk_rows):
        sl = slice(i, i + chunk_rows)
        if torch.is_grad_enabled():
            part, ok = checkpoint(_chunk_loss, rows[sl], ys[sl], ws[sl], lm_head, use_reentrant=False)
        else:
            part, ok = _chunk_loss(rows[sl], ys[sl], ws[sl], lm_head)
        total = total + part
        correct.append(ok)
    loss = total / norm
    with torch.no_grad():
        grid = torch.zeros_like(use)
        if correct:
            grid[use] = torch.cat(correct)
        per_k = grid.sum((0, 1)).float() / use.sum((0, 1)).clamp(min=1).float()
        full = has_label.all(-1).float()
        run = torch.cumprod(grid.long(), dim=-1)  # [B, A, bs-1]: still accepted at k
        accept = (run.float() * full[..., None]).sum((0, 1)) / full.sum()  # NaN when no full block
        if row_sample is not None:
            accept = torch.full_like(accept, float("nan"))
        tau = 1.0 + accept.sum()
    return loss, {"acc": per_k, "accept": accept, "tau": tau}


def stats_to_host(stats: dict) -> dict:
    """{"acc": [floats], "accept": [floats] or None, "tau": float or None} from `block_loss`
    stats (one host sync)."""
    acc = [round(float(x), 4) for x in stats["acc"].tolist()]
    accept = [float(x) for x in stats["accept"].tolist()]
    tau = float(stats["tau"])
    ok = not math.isnan(tau)
    return {"acc": acc, "accept": [round(x, 4) for x in accept] if ok else None,
            "tau": round(tau, 4) if ok else None}
