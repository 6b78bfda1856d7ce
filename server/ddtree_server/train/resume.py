"""The carried training state: what a GPU run returns so that the next run, on a fresh machine,
picks up where it stopped.

A state folder holds, and only holds (the GPU machine returns at most 8 files of <= 16 MiB):
  progress.json            step, runs so far, prompt cursor (`next_job`), seeds, RNG state, the
                           drafter's config.json, the settings, the last validation, and the
                           names + sha256 of the weight parts below
  weights-NNNN.partKK      the drafter's model.safetensors (bf16, z-lab format), cut in <= 15 MiB parts
  train_log.jsonl          the training log of every run so far (appended by train/pipeline.py)
  run.log                  the console of the last run (written by scripts/gpu_train_drafter.sh)

Saving is a commit: the new parts are written under a new number, then progress.json is replaced
atomically (write + rename), then the parts it no longer names are deleted. A run killed at any
moment (SIGKILL at the machine's limit) therefore leaves a folder whose progress.json names
complete parts; at most 8 files exist at any time (2 old + 2 new parts, progress.json and its
temporary, the two logs). Optimizer moments (2 x 48 MB in fp32) do not fit: a resumed run starts
a fresh AdamW (train/trainer.py: warm restart).

`python -m ddtree_server.train.resume export STATE DEST` writes the z-lab drafter folder
(config.json + model.safetensors) to DEST; `show STATE` prints the progress.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import torch

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.load import WEIGHTS, save_drafter

PROGRESS = "progress.json"
PART_BYTES = 15 * 2**20
FORMAT = 1


class StateError(ValueError):
    """A state folder is missing, incomplete or altered; the message names the file."""


def save_state(state_dir: str | Path, drafter: DFlashDrafter, progress: dict, scratch: str | Path) -> dict:
    """Write `drafter` (bf16) and `progress` into state_dir as one commit (module docstring).

    scratch: a folder outside state_dir for the temporary z-lab export. Returns the progress
    document as written (with "format", "config" and "weights" filled in)."""
    state, scratch = Path(state_dir), Path(scratch)
    state.mkdir(parents=True, exist_ok=True)
    folder = save_drafter(drafter, scratch / "export", dtype=torch.bfloat16)
    blob = (folder / WEIGHTS).read_bytes()
    old = read_progress(state) if (state / PROGRESS).exists() else {}
    number = int(old.get("weights", {}).get("number", -1)) + 1
    parts = []
    for i, start in enumerate(range(0, len(blob), PART_BYTES)):
        name = f"weights-{number:04d}.part{i:02d}"
        (state / name).write_bytes(blob[start:start + PART_BYTES])
        parts.append(name)
    doc = dict(progress, format=FORMAT, config=json.loads((folder / "config.json").read_text()),
               weights={"number": number, "parts": parts, "bytes": len(blob),
                        "sha256": hashlib.sha256(blob).hexdigest()})
    tmp = state / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, state / PROGRESS)
    for p in state.glob("weights-*.part*"):
        if p.name not in parts:
            p.unlink()
    return doc


def read_progress(state_dir: str | Path) -> dict:
    """progress.json of a state folder. Raises StateError when it is missing or not a state."""
    path = Path(state_dir) / PROGRESS
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{path}: no such file (not a training state folder)") from None
    except json.JSONDecodeError as exc:
        raise StateError(f"{path}: not JSON ({exc})") from None
    if doc.get("format") != FORMAT or "weights" not in doc or "config" not in doc:
        raise StateError(f"{path}: not a format-{FORMAT} training state")
    return doc


def export(state_dir: str | Path, dest: str | Path) -> Path:
    """Join the weight parts into dest/model.safetensors, write dest/config.json; returns dest.
    Raises StateError naming a missing part or a sha256 mismatch."""
    state, dest = Path(state_dir), Path(dest)
    doc = read_progress(state)
    chunks = []
    for name in doc["weights"]["parts"]:
        try:
            chunks.append((state / name).read_bytes())
        except FileNotFoundError:
            raise StateError(f"{state / name}: missing weight part") from None
    blob = b"".join(chunks)
    if hashlib.sha256(blob).hexdigest() != doc["weights"]["sha256"]:
        raise StateError(f"{state}: the weight parts do not match the sha256 in {PROGRESS}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / (WEIGHTS + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, dest / WEIGHTS)
    (dest / "config.json").write_text(json.dumps(doc["config"], indent=2) + "\n")
    return dest


def rng_state() -> dict:
    """The process's torch CPU RNG state as hex text (for progress.json)."""
    return {"torch_cpu": torch.get_rng_state().numpy().tobytes().hex()}


def set_rng_state(doc: dict) -> None:
    """Restore what `rng_state` saved (no-op for a missing entry)."""
    hexed = (doc or {}).get("torch_cpu")
    if hexed:
        torch.set_rng_state(torch.frombuffer(bytearray(bytes.fromhex(hexed)), dtype=torch.uint8))


def main(argv: list[str] | None = None) -> None:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the z-lab drafter folder of a state")
    e.add_argument("state")
    e.add_argument("dest")
    s = sub.add_parser("show", help="print the progress of a state")
    s.add_argument("state")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "export":
            print(export(args.state, args.dest))
            return
        doc = read_progress(args.state)
    except StateError as exc:
        raise SystemExit(str(exc)) from None
    keep = ("step", "next_job", "runs", "val", "complete", "target")
    print(json.dumps({k: doc.get(k) for k in keep}, indent=1))


if __name__ == "__main__":
    main()
