"""Training checkpoints: the servable z-lab folder plus a resumable optimizer state.

`save_checkpoint` writes the drafter in the z-lab format (config.json + model.safetensors in bf16,
via `models/drafter/load.py`'s `save_drafter`, so the server loads it unchanged) to `out_dir`, and the fp32
master weights + AdamW state + step to `state_path` (kept out of `out_dir`: it is 6x larger).
`load_checkpoint` restores both for `--resume`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.load import save_drafter
from ddtree_server.train.trainer import Trainer


def save_checkpoint(trainer: Trainer, out_dir: str | Path, state_path: str | Path,
                    dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the z-lab folder (dtype) and the resumable state (fp32 + optimizer), atomically."""
    save_drafter(trainer.drafter, out_dir, dtype=dtype)
    state = {"drafter_config": trainer.drafter.config.to_dict(),
             "drafter": {k: v.detach().cpu() for k, v in trainer.drafter.state_dict().items()},
             "optimizer": trainer.opt.state_dict(), "step": trainer.step}
    path = Path(state_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_state_config(state_path: str | Path) -> DrafterConfig:
    """The DrafterConfig stored in a training state (to rebuild the module before resuming)."""
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    return DrafterConfig.from_dict(state["drafter_config"], source=str(state_path))


def load_checkpoint(trainer: Trainer, state_path: str | Path) -> None:
    """Restore weights, optimizer and step into `trainer` (whose drafter has the stored config).
    Raises ValueError if the stored config differs from the trainer's drafter."""
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    stored = DrafterConfig.from_dict(state["drafter_config"], source=str(state_path))
    if stored != trainer.drafter.config:
        raise ValueError(f"{state_path}: drafter config differs from the requested one; "
                         "drop --resume or use the same drafter options")
    trainer.drafter.load_state_dict(state["drafter"], strict=True)
    trainer.opt.load_state_dict(state["optimizer"])
    trainer.step = int(state["step"])


def new_or_resumed(config: DrafterConfig, embed_tokens, lm_head, device) -> DFlashDrafter:
    """A fp32 drafter on `device` bound to the target's embedding and LM head."""
    return DFlashDrafter(config, embed_tokens, lm_head).to(device=device, dtype=torch.float32)
