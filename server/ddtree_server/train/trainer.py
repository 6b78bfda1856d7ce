"""The drafter training loop: frozen target features -> block-diffusion loss -> AdamW.

Per step: a batch of stored sequences (right padded), the target's layer features for every
position (`features.capture_features`, no grad), random anchors in each response
(`objective.sample_anchors`), `DFlashDrafter.forward_train`, weighted CE (`objective.block_loss`).
bf16 autocast on CUDA, fp32 master weights. The LR warms up linearly, then follows a cosine to
`min_lr_ratio` over the run's budget (steps or minutes, whichever ends first). Batches come from a
seeded per-epoch permutation, so a resumed run continues the same order.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ddtree_server.models.drafter import DFlashDrafter
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
              weights: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Loss and stats of one batch (gradients flow into the drafter only)."""
    dev = drafter.fc.weight.device
    ids, seq_lens, lens, plens = collate(seqs, dev)
    anchors, valid = sample_anchors(plens, lens, anchors_per_seq, gen)
    anchors, valid = anchors.to(dev), valid.to(dev)
    with _autocast(dev):
        feats = capture_features(target, ids, drafter.config.target_layer_ids)
        hidden = drafter.forward_train(feats, ids, anchors, valid)
        return block_loss(hidden, ids, seq_lens, anchors, valid, weights, drafter.lm_head)


def lr_at(s: TrainSettings, step: int, progress: float) -> float:
    """Learning rate for `step` at budget fraction `progress` in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, s.warmup_steps))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return s.lr * warm * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cos)


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: nn.Module, seqs: list[Sequence], s: TrainSettings) -> dict:
    """Held-out loss, per-position accuracy and simulated chain tau (fixed anchors, seed 1234)."""
    if not seqs:
        return {}
    drafter.eval()
    gen = torch.Generator().manual_seed(1234)
    w = position_weights(drafter.config.block_size, s.gamma, drafter.fc.weight.device)
    losses, taus, accs = [], [], []
    for i in range(0, len(seqs), s.batch_size):
        loss, st = step_loss(drafter, target, seqs[i:i + s.batch_size], s.anchors, w, gen)
        st = stats_to_host(st)
        losses.append(float(loss))
        accs.append(st["acc"])
        if st["tau"] is not None:
            taus.append(st["tau"])
    drafter.train()
    acc = [round(sum(col) / len(col), 4) for col in zip(*accs)]
    return {"val_loss": sum(losses) / len(losses), "val_tau": sum(taus) / len(taus) if taus else None,
            "val_acc": acc}


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
        """Sequences of `step`: slice of the seeded permutation of its epoch (deterministic)."""
        n, b = len(self.seqs), min(self.s.batch_size, len(self.seqs))
        start = step * b
        epoch, off = divmod(start, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.s.seed * 100_003 + epoch))
        idx = perm[off:off + b].tolist()
        if len(idx) < b:
            nxt = torch.randperm(n, generator=torch.Generator().manual_seed(self.s.seed * 100_003 + epoch + 1))
            idx += nxt[: b - len(idx)].tolist()
        return [self.seqs[i] for i in idx]

    def run(self, on_log: Callable[[dict], None] | None = None,
            on_save: Callable[[int], None] | None = None, save_every_s: float = 0.0) -> dict:
        """Train until `steps` or `max_minutes`; calls on_log(record) every log_every steps and
        on_save(step) every save_every_s seconds. Returns the last log record."""
        s, t0 = self.s, time.monotonic()
        budget = s.max_minutes * 60.0
        last_save, last_refresh, record, tokens = t0, t0, {}, 0
        start_step = self.step
        while True:
            elapsed = time.monotonic() - t0
            done_steps = self.step - start_step
            progress = max(done_steps / s.steps if s.steps else 0.0, elapsed / budget if budget else 0.0)
            if progress >= 1.0:
                break
            lr = lr_at(s, self.step, progress)
            for group in self.opt.param_groups:
                group["lr"] = lr
            seqs = self.batch(self.step)
            gen = torch.Generator().manual_seed(s.seed * 7919 + self.step)
            loss, st = step_loss(self.drafter, self.target, seqs, s.anchors, self.weights, gen)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), s.grad_clip)
            self.opt.step()
            self.step += 1
            tokens += sum(len(x.ids) for x in seqs)
            if self.step % s.log_every == 0 or self.step == start_step + 1:
                now = time.monotonic() - t0
                st = stats_to_host(st)
                record = {"step": self.step, "loss": round(float(loss.detach()), 5), "tau": st["tau"],
                          "acc": st["acc"], "lr": lr, "grad_norm": round(float(gnorm), 4),
                          "elapsed_s": round(now, 2), "progress": round(progress, 4),
                          "tokens_per_s": round(tokens / max(now, 1e-9), 1), "sequences": len(self.seqs)}
                if on_log:
                    on_log(record)
            if self.more is not None and time.monotonic() - last_refresh > self.refresh_s:
                self.seqs.extend(self.more())
                last_refresh = time.monotonic()
            if on_save and save_every_s and time.monotonic() - last_save > save_every_s:
                on_save(self.step)
                last_save = time.monotonic()
        return record
