"""Training sequences: chat prompts answered by the target itself, cached on disk in shards.

Each prompt is wrapped in the target's chat template; the target answers it with transformers'
batched `generate()` (left padding), greedily or with plain temperature sampling (a seeded
per-prompt choice, `sampled_fraction` of them). Every batch becomes one shard file
`shard_XXXXX.pt` ({"index", "prompt_ids", "response_ids", "sampled"}) written atomically, so an
interrupted run resumes where it stopped; `manifest.json` pins the settings of the folder.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class GenSettings:
    """Data generation settings (tokens / seconds)."""

    max_prompt_tokens: int = 256     # longer chat-formatted prompts are skipped
    max_new_tokens: int = 256
    batch_size: int = 256
    sampled_fraction: float = 0.25   # share of prompts answered with temperature sampling
    temperature: float = 0.8
    seed: int = 0


@dataclass
class Sequence:
    """One training sequence: ids [T] (prompt then response) and the prompt length."""

    ids: torch.Tensor
    prompt_len: int


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int,
                   indices=None) -> list[tuple[int, list[int]]]:
    """(prompt index, chat-formatted token ids) for the prompts at `indices` (default: all) that
    fit in max_prompt_tokens."""
    out = []
    for i in range(len(prompts)) if indices is None else indices:
        text = prompts[i]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) <= max_prompt_tokens:
            out.append((i, list(ids)))
    return out


def _done(folder: Path) -> set[int]:
    done: set[int] = set()
    for shard in sorted(folder.glob("shard_*.pt")):
        done.update(torch.load(shard, weights_only=True)["index"])
    return done


def _check_manifest(folder: Path, doc: dict) -> None:
    path = folder / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != doc:
            raise ValueError(f"{folder} holds data made with other settings ({old}); use another --work-dir")
    else:
        path.write_text(json.dumps(doc, indent=2))


@torch.no_grad()
def _generate(model: nn.Module, batch: list[list[int]], sampled: bool, s: GenSettings, pad_id: int,
              eos_ids: list[int]) -> list[list[int]]:
    dev = next(model.parameters()).device
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, width - len(x):] = torch.tensor(x)
        mask[r, width - len(x):] = 1
    kw = dict(do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=s.max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=eos_ids, **kw)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        responses.append(row[:cut])
    return responses


def _batch_order(todo: list[tuple[int, list[int]]], flags: list[bool], batch_size: int) -> list[tuple[int, list[int]]]:
    """Prompt order of a run: the given (shuffled) order, sorted by length only inside windows of
    4 batches (similar lengths share a batch: less padding), so a run cut short by its deadline
    still answers prompts of every length, not just the shortest ones."""
    window = max(1, 4 * batch_size)
    out: list[tuple[int, list[int]]] = []
    for start in range(0, len(todo), window):
        out += sorted(todo[start:start + window], key=lambda x: (flags[x[0]], len(x[1])))
    return out


def generate_shards(model: nn.Module, tokenizer, prompts: list[str], folder: str | Path, s: GenSettings, *,
                    eos_ids: list[int], mask_token_id: int, target_id: str, deadline: float | None = None,
                    shard: tuple[int, int] | None = None, progress=None) -> int:
    """Answer `prompts` with the target into shard files under `folder`; returns the number of
    sequences now stored. Already-stored prompt indices are skipped (resume). Stops starting new
    batches after `deadline` (time.monotonic()). Responses containing `mask_token_id` are dropped.
    shard (i, n): answer only the prompts whose index is i modulo n (several workers, disjoint data;
    the folder is bound to its shard). progress: optional callable(done, total).
    Raises ValueError if the folder holds other settings or the shard is not 0 <= i < n."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"target": target_id, "settings": asdict(s)}
    if shard is not None:
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"prompt shard {shard[0]}/{shard[1]}: need 0 <= i < n")
        doc["shard"] = list(shard)
    _check_manifest(folder, doc)
    done = _done(folder)
    rng = random.Random(s.seed)
    flags = [rng.random() < s.sampled_fraction for _ in prompts]
    mine = range(len(prompts)) if shard is None else range(shard[0], len(prompts), shard[1])
    todo = [(i, ids) for i, ids in encode_prompts(tokenizer, prompts, s.max_prompt_tokens, mine) if i not in done]
    todo = _batch_order(todo, flags, s.batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    stored, total = len(done), len(done) + len(todo)
    shard_no = len(list(folder.glob("shard_*.pt")))
    seeded = torch.Generator().manual_seed(s.seed)
    for start in range(0, len(todo), s.batch_size):
        if deadline is not None and time.monotonic() > deadline:
            break
        chunk = todo[start:start + s.batch_size]
        groups = {False: [c for c in chunk if not flags[c[0]]], True: [c for c in chunk if flags[c[0]]]}
        rec = {"index": [], "prompt_ids": [], "response_ids": [], "sampled": []}
        for sampled, items in groups.items():
            if not items:
                continue
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=seeded)))
            for (i, p), resp in zip(items, _generate(model, [p for _, p in items], sampled, s, pad_id, eos_ids)):
                rec["index"].append(i)
                if mask_token_id in resp or not resp:
                    continue
                rec["prompt_ids"].append(p)
                rec["response_ids"].append(resp)
                rec["sampled"].append(sampled)
        tmp = folder / f".shard_{shard_no:05d}.pt.tmp"
        torch.save(rec, tmp)
        os.replace(tmp, folder / f"shard_{shard_no:05d}.pt")
        shard_no += 1
        stored += len(chunk)
        if progress:
            progress(stored, total)
    return sum(len(torch.load(p, weights_only=True)["response_ids"]) for p in folder.glob("shard_*.pt"))


def check_extra_folder(folder: str | Path, own: str | Path, target_id: str | None = None,
                       own_shard: tuple[int, int] | None = None) -> None:
    """Check a folder given to train on besides this run's own `own` data folder (another worker's):
    an existing directory, not `own` itself, and a data folder (`manifest.json`) made for the same
    target (`target_id`, once known) and not for this run's own prompt shard. An existing EMPTY
    directory passes (a worker that has not started yet; its shards are picked up when they come).
    Raises ValueError naming the folder and what is wrong."""
    folder, own = Path(folder), Path(own)
    if not folder.is_dir():
        raise ValueError(f"--extra-data {folder}: no such directory")
    if folder.resolve() == own.resolve():
        raise ValueError(f"--extra-data {folder}: that is this run's own data folder")
    if not (folder / "manifest.json").is_file():
        if (folder / "data" / "manifest.json").is_file():
            raise ValueError(f"--extra-data {folder}: a work folder; its data folder is {folder / 'data'}")
        if any(folder.iterdir()):
            raise ValueError(f"--extra-data {folder}: not a data folder (no manifest.json)")
        return  # empty: the other worker has not started yet
    if target_id is None:
        return
    doc = json.loads((folder / "manifest.json").read_text())
    if doc.get("target") != target_id:
        raise ValueError(f"--extra-data {folder}: made for target {doc.get('target')!r}, not {target_id!r}")
    if own_shard is not None and doc.get("shard") == list(own_shard):
        raise ValueError(f"--extra-data {folder}: holds the same prompt shard {own_shard[0]}/{own_shard[1]} "
                         "as this run (duplicate data)")


def load_sequences(folder: str | Path, max_len: int, seen: set[str] | None = None) -> list[Sequence]:
    """All stored sequences (prompt + response, cut to max_len tokens), in shard order.
    Sequences whose prompt leaves no response token within max_len are skipped. With `seen`,
    shards whose path is in it are skipped and the loaded ones are added (to pick up the shards
    another process has written since the last call; shards appear atomically)."""
    out = []
    for shard in sorted(Path(folder).glob("shard_*.pt")):
        if seen is not None:
            if str(shard) in seen:
                continue
            seen.add(str(shard))
        rec = torch.load(shard, weights_only=True)
        for p, r in zip(rec["prompt_ids"], rec["response_ids"]):
            ids = (p + r)[:max_len]
            if len(ids) >= len(p) + 2:
                out.append(Sequence(torch.tensor(ids, dtype=torch.long), len(p)))
    return out
