"""Load and save z-lab DFlash drafter folders (config.json + model.safetensors, maybe sharded).

Loading is strict (docs/ddtree.md §1.3): every tensor of the module must be present with
its exact shape and nothing else may be in the files; the drafter must fit the target (hidden
size, vocabulary, layer ids < target depth, `fc` input width == len(layer ids) * target hidden).
Any violation raises `DrafterLoadError` naming the folder and the tensor or key.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddtree_server.models.drafter.config import DrafterConfig, DrafterConfigError
from ddtree_server.models.drafter.model import DFlashDrafter

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class DrafterLoadError(ValueError):
    """The drafter folder does not match the module or the target; the message names the tensor."""


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> file that holds it (single file or sharded index)."""
    index = folder / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise DrafterLoadError(f"{index}: no usable 'weight_map' ({exc})") from None
        return {name: folder / shard for name, shard in weight_map.items()}
    single = folder / WEIGHTS
    if not single.exists():
        raise DrafterLoadError(f"{folder}: neither {WEIGHTS} nor {INDEX} found")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _check_target(cfg: DrafterConfig, folder: Path, hidden: int, layers: int, vocab: int) -> None:
    if cfg.hidden_size != hidden:
        raise DrafterLoadError(f"{folder}: config hidden_size {cfg.hidden_size} != target hidden size {hidden} "
                               "(the drafter reuses the target's embeddings)")
    if cfg.vocab_size != vocab:
        raise DrafterLoadError(f"{folder}: config vocab_size {cfg.vocab_size} != target vocabulary {vocab}")
    bad = [i for i in cfg.target_layer_ids if i >= layers]
    if bad:
        raise DrafterLoadError(f"{folder}: dflash_config.target_layer_ids {list(cfg.target_layer_ids)} "
                               f"has {bad} >= target depth {layers}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != layers:
        raise DrafterLoadError(f"{folder}: config num_target_layers {cfg.num_target_layers} != target depth {layers}")


def load_drafter(path: str | Path, *, embed_tokens: nn.Module, lm_head: nn.Module, target_hidden_size: int,
                 target_num_layers: int, target_vocab_size: int, target_layer_ids: list[int] | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Build a DFlashDrafter from a z-lab folder and bind the target's embedding / LM head.

    target_layer_ids: the operator's explicit ids (needed only when the config has none).
    dtype: parameter dtype (default: the checkpoint's). Raises DrafterLoadError (wrong tensors,
    mismatch with the target) or DrafterConfigError (bad config.json).
    """
    folder = Path(path)
    cfg = DrafterConfig.from_file(folder, target_layer_ids=target_layer_ids)
    _check_target(cfg, folder, target_hidden_size, target_num_layers, target_vocab_size)
    rows = getattr(getattr(embed_tokens, "weight", None), "shape", (target_vocab_size,))[0]
    if cfg.mask_token_id >= rows:
        raise DrafterLoadError(f"{folder}: dflash_config.mask_token_id {cfg.mask_token_id} has no embedding row "
                               f"(target embedding has {rows} rows)")
    if (folder / "mask_embedding.pt").exists():
        raise DrafterLoadError(f"{folder}: mask_embedding.pt (a replaced mask embedding) is not supported")

    with torch.device("meta"):
        drafter = DFlashDrafter(cfg, embed_tokens, lm_head)
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    files = _weight_files(folder)
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise DrafterLoadError(f"{folder}: unexpected tensor '{unexpected[0]}'"
                               + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    missing = sorted(set(expected) - set(files))
    if missing:
        raise DrafterLoadError(f"{folder}: missing tensor '{missing[0]}'"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        if not file.exists():
            raise DrafterLoadError(f"{folder}: shard {file.name} listed in {INDEX} is missing")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if files.get(name) != file:
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    why = ""
                    if name == "fc.weight":
                        why = (f"; fc input width must be len(target_layer_ids)={len(cfg.target_layer_ids)}"
                               f" x target hidden {target_hidden_size} = {cfg.context_width}")
                    raise DrafterLoadError(f"{folder}: tensor '{name}' has shape {list(t.shape)}, "
                                           f"expected {list(expected[name])}{why}")
                tensors[name] = t
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    drafter = drafter.to_empty(device=device)
    drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return drafter.to(dtype).eval().requires_grad_(False)


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `drafter` as a z-lab folder: config.json (architectures ["DFlashDraftModel"],
    dflash_config{mask_token_id, target_layer_ids, block_size}, rope_parameters, ...) and
    model.safetensors in `dtype`. Files are replaced atomically. Returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = drafter.config.to_dict()
    doc["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    _atomic(out / WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    _atomic(out / "config.json", lambda p: p.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8"))
    return out


def _atomic(dest: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the folder is served by other users too
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


__all__ = ["DrafterConfigError", "DrafterLoadError", "load_drafter", "save_drafter"]
