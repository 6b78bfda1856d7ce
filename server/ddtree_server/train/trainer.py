"""The drafter training loop: frozen target features -> block-diffusion loss -> AdamW.

Per step: a batch of stored sequences (right padded), the target's layer features for every
position (`features.capture_features`, no grad), random anchors in each response
(`objective.sample_anchors`), `DFlashDrafter.forward_train`, weighted CE (`objective.block_loss`,
optionally on sampled rows). bf16 autocast on CUDA, fp32 master weights.

Schedule: each call of `run` is one cycle: linear warm-up over `warmup_steps`, then a cosine to
`min_lr_ratio` over the run's budget (steps or minutes, whichever ends first). A run resumed on a
fresh machine starts a new cycle from the carried weights with a fresh optimizer (a warm restart,
as in SGDR: Loshchilov & Hutter 2017, "SGDR: Stochastic Gradient Descent with Warm Restarts").

Batches: a seeded permutation per epoch, cut into windows of `bucket` batches; inside a window the
sequences are sorted by length before they are cut into batches (less padding in the target
forward: a random batch of 32 pads to its longest member, about twice the mean), and the window's
batches run in a seeded random order. Everything depends only on (seed, epoch, step), so a resumed
run on the same data continues the same order.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.layers import attention_backends
from ddtree_server.train.data import Sequence
from ddtree_server.train.features import capture_features
from ddtree_server.train.objective import block_loss, position_weights, sample_anchors, stats_to_host


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings (counts, minutes)."""

    steps: int = 0                 # 0: run until max_minutes
    max_minutes: float = 0.0       # 0: no time limit (then steps must be > 0)
    batch_size: int = 16           # sequences per step
    anchors: int = 48              # blocks per sequence
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float = 7.0             # loss weight decay over in-block positions
    seed: int = 0
    log_every: int = 10
    row_sample: bool = False       # LM head on importance-sampled rows (objective.py)
    bucket: int = 8                # batches per length-sorted window (1: plain random batches)


def collate(seqs: list[Sequence], device) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """Right-padded ids [B, T], seq_lens long [B], and python lists of seq / prompt lengths."""
    lens = [len(s.ids) for s in seqs]
    ids = torch.zeros((len(seqs), max(lens)), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s.ids)] = s.ids
    return ids.to(device), torch.tensor(lens, device=device), lens, [s.prompt_len for s in seqs]


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def step_loss(drafter: DFlashDrafter, target: nn.Module, seqs: list[Sequence], anchors_per_seq: int,
              weights: torch.Tensor, gen: torch.Generator, row_sample: bool = False) -> tuple[torch.Tensor, dict]:
    """Loss and stats of one batch (gradients flow into the drafter only)."""
    dev = drafter.fc.weight.device
    ids, seq_lens, lens, plens = collate(seqs, dev)
    anchors, valid = sample_anchors(plens, lens, anchors_per_seq, gen)
    anchors, valid = anchors.to(dev), valid.to(dev)
    with _autocast(dev), attention_backends(dev):  # off cuDNN: it plans anew for every batch length
        feats = capture_features(target, ids, drafter.config.target_layer_ids)
        hidden = drafter.forward_train(feats, ids, anchors, valid)
        return block_loss(hidden, ids, seq_lens, anchors, valid, weights, drafter.lm_head,
                          row_sample=gen if row_sample else None)


def lr_at(s: TrainSettings, step: int, progress: float) -> float:
    """Learning rate for the run's `step` (counted from the start of this run) at budget
    fraction `progress` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, s.warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return s.lr * warm * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cos)


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: nn.Module, seqs: list[Sequence], s: TrainSettings) -> dict:
    """Held-out loss, per-position accuracy (`val_acc`), simulated greedy chain acceptance per
    position (`val_accept`: share of blocks whose leading run of correct drafts reaches position
    k) and chain tau (`val_tau` = 1 + sum(val_accept)); fixed anchors (seed 1234), every row."""
    if not seqs:
        return {}
    drafter.eval()
    gen = torch.Generator().manual_seed(1234)
    w = position_weights(drafter.config.block_size, s.gamma, drafter.fc.weight.device)
    losses, sizes, accs, accepts = [], [], [], []
    for i in range(0, len(seqs), s.batch_size):
        part = seqs[i:i + s.batch_size]
        loss, st = step_loss(drafter, target, part, s.anchors, w, gen)
        st = stats_to_host(st)
        losses.append(float(loss))
        sizes.append(len(part))
        accs.append(st["acc"])
        if st["accept"] is not None:
            accepts.append(st["accept"])
    drafter.train()
    acc = [round(sum(col) / len(col), 4) for col in zip(*accs)]
    accept = [round(sum(col) / len(col), 4) for col in zip(*accepts)] if accepts else None
    return {"val_loss": sum(x * n for x, n in zip(losses, sizes)) / sum(sizes),
            "val_tau": round(1.0 + sum(accept), 4) if accept else None, "val_acc": acc, "val_accept": accept}


class Trainer:
    """Owns the optimizer and the step counter of one drafter; `run` trains until the budget ends."""

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, train_seqs: list[Sequence], s: TrainSettings):
        if s.steps <= 0 and s.max_minutes <= 0:
            raise ValueError("give a step count or a time budget (max_minutes)")
        if not train_seqs:
            raise ValueError("no training sequences")
        self.drafter, self.target, self.seqs, self.s = drafter.train(), target.eval(), train_seqs, s
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)
        self.step = 0
        self.weights = position_weights(drafter.config.block_size, s.gamma, drafter.fc.weight.device)
        # optional source of sequences that arrive during training (another GPU generating): called
        # every refresh_s seconds, its sequences join the pool (the batch order then follows arrival)
        self.more: Callable[[], list[Sequence]] | None = None
        self.refresh_s = 60.0

    def batch(self, step: int) -> list[Sequence]:
        """Sequences of `step` (deterministic in seed, epoch and step; see the module docstring)."""
        n, b = len(self.seqs), min(self.s.batch_size, len(self.seqs))
        per_epoch = max(1, n // b)
        epoch, k = divmod(step, per_epoch)
        cached = getattr(self, "_perm", None)
        if cached is None or cached[:2] != (epoch, n):
            gen = torch.Generator().manual_seed(self.s.seed * 100_003 + epoch)
            self._perm = cached = (epoch, n, torch.randperm(n, generator=gen).tolist())
        perm = cached[2]
        w = max(1, self.s.bucket)
        first = (k // w) * w
        count = min(first + w, per_epoch) - first
        window = sorted(perm[first * b:(first + count) * b], key=lambda i: len(self.seqs[i].ids))
        order = torch.randperm(count, generator=torch.Generator().manual_seed(
            self.s.seed * 7_919 + epoch * 1_009 + first)).tolist()
        j = order[k - first]
        return [self.seqs[i] for i in window[j * b:(j + 1) * b]]

    def run(self, on_log: Callable[[dict], None] | None = None,
            on_save: Callable[[int], None] | None = None, save_every_s: float = 0.0,
            on_val: Callable[[int], None] | None = None, val_every_s: float = 0.0,
            should_stop: Callable[[], bool] | None = None) -> dict:
        """Train until `steps` or `max_minutes` (or should_stop() turns true); calls on_log(record)
        every log_every steps, on_save(step) every save_every_s seconds and on_val(step) every
        val_every_s seconds. Returns the last log record."""
        s, t0 = self.s, time.monotonic()
        budget = s.max_minutes * 60.0
        last_save = last_refresh = last_val = t0
        record: dict = {}
        tokens = real = padded = 0
        start_step = self.step
        while not (should_stop and should_stop()):
            elapsed = time.monotonic() - t0
            done_steps = self.step - start_step
            progress = max(done_steps / s.steps if s.steps else 0.0, elapsed / budget if budget else 0.0)
            if progress >= 1.0:
                break
            lr = lr_at(s, done_steps, progress)
            for group in self.opt.param_groups:
                group["lr"] = lr
            seqs = self.batch(self.step)
            logging_step = (self.step + 1) % s.log_every == 0 or done_steps == 0
            gen = torch.Generator().manual_seed(s.seed * 7919 + self.step)
            loss, st = step_loss(self.drafter, self.target, seqs, s.anchors, self.weights, gen,
                                 row_sample=s.row_sample and not logging_step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), s.grad_clip)
            self.opt.step()
            self.step += 1
            lens = [len(x.ids) for x in seqs]
            tokens += sum(lens)
            real, padded = real + sum(lens), padded + max(lens) * len(lens)
            if logging_step:
                now = time.monotonic() - t0
                st = stats_to_host(st)
                record = {"step": self.step, "loss": round(float(loss.detach()), 5), "tau": st["tau"],
                          "acc": st["acc"], "lr": lr, "grad_norm": round(float(gnorm), 4),
                          "elapsed_s": round(now, 2), "progress": round(progress, 4),
                          "tokens_per_s": round(tokens / max(now, 1e-9), 1),
                          "steps_per_s": round((self.step - start_step) / max(now, 1e-9), 3),
                          "pad_fraction": round(1 - real / max(padded, 1), 4), "sequences": len(self.seqs)}
                if on_log:
                    on_log(record)
            if self.more is not None and time.monotonic() - last_refresh > self.refresh_s:
                self.seqs.extend(self.more())
                last_refresh = time.monotonic()
            if on_val and val_every_s and time.monotonic() - last_val > val_every_s:
                on_val(self.step)
                last_val = time.monotonic()
            if on_save and save_every_s and time.monotonic() - last_save > save_every_s:
                on_save(self.step)
                last_save = time.monotonic()
        return record
