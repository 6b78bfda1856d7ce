"""Training sequences: chat prompts answered by the target itself, cached on disk in shards.

Jobs: job j answers prompt `j mod N` of the prompt pool (N prompts) in pass `j // N`. In pass 0 a
seeded per-prompt draw picks greedy or temperature sampling (`sampled_fraction` sampled); every
later pass samples, so each pass adds new answers to the same prompts. A run answers the jobs
[start_job, ...) in order until its deadline; one past the last job it answered is the cursor the
next run (on a fresh machine) starts from (train/resume.py keeps it).

Answers come from train/answer.py (the batched static-cache generator, checked once, or
transformers' `generate()`). Every batch becomes one shard file
`shard_XXXXX.pt` ({"index": job ids, "sampled": flags, "tokens": int32 prompt + response of the
kept answers back to back, "prompt_lens" / "lens": int32 per kept answer}; tensors, not lists, so
that loading 100 K answers takes a second, not minutes) written atomically, so an interrupted run resumes where it stopped on the same machine;
`manifest.json` pins the settings of the folder.
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

from ddtree_server.train.answer import Answerer, GenSettings


HF_BATCH_ROWS = 1024  # batch cap when answering with transformers' generate()


@dataclass
class Sequence:
    """One training sequence: ids [T] (prompt then response) and the prompt length."""

    ids: torch.Tensor
    prompt_len: int


@dataclass
class GenResult:
    """What one `generate_shards` call did (counts, seconds, tokens/s of new tokens)."""

    sequences: int = 0          # sequences stored in the folder
    next_job: int = 0           # the resume cursor: one past the last job answered
    jobs_done: int = 0          # jobs answered by this call
    new_tokens: int = 0         # response tokens produced by this call (up to the stop token)
    seconds: float = 0.0
    engine: str = "static"

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int,
                   indices=None) -> list[tuple[int, list[int]]]:
    """(prompt index, chat-formatted token ids) for the prompts at `indices` (default: all) that
    fit in max_prompt_tokens. Renders the chat template as text and tokenizes all prompts in one
    batch call (fast tokenizers run it in parallel); if that differs from
    `apply_chat_template(tokenize=True)` on the first prompts, encodes one by one."""
    idx = list(range(len(prompts)) if indices is None else indices)
    encoded = None
    try:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompts[i]}],
                                               add_generation_prompt=True, tokenize=False) for i in idx]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        if any(list(encoded[k]) != _chat_ids(tokenizer, prompts[i]) for k, i in enumerate(idx[:8])):
            encoded = None
    except (TypeError, ValueError, KeyError):
        encoded = None
    if encoded is None:
        encoded = [_chat_ids(tokenizer, prompts[i]) for i in idx]
    return [(i, list(ids)) for i, ids in zip(idx, encoded) if len(ids) <= max_prompt_tokens]


def job_flags(n_prompts: int, s: GenSettings) -> list[bool]:
    """Pass-0 sampled flag of every prompt (seeded)."""
    rng = random.Random(s.seed)
    return [rng.random() < s.sampled_fraction for _ in range(n_prompts)]


def _done(folder: Path) -> tuple[set[int], int]:
    """(job ids already answered in `folder`, sequences stored there)."""
    done: set[int] = set()
    stored = 0
    for shard in sorted(folder.glob("shard_*.pt")):
        rec = torch.load(shard, weights_only=True)
        done.update(rec["index"])
        stored += len(rec["lens"]) if "lens" in rec else len(rec["response_ids"])
    return done, stored


def _check_manifest(folder: Path, doc: dict) -> None:
    path = folder / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != doc:
            raise ValueError(f"{folder} holds data made with other settings ({old}); use another --work-dir")
    else:
        path.write_text(json.dumps(doc, indent=2))


def _batch_order(todo: list[tuple[int, list[int]]], flags: list[bool], batch_size: int) -> list[tuple[int, list[int]]]:
    """Job order of a run: the given order, sorted by prompt length only inside windows of 4
    batches (similar lengths share a batch: less padding), so a run cut short by its deadline
    still answers prompts of every length, not just the shortest ones. flags[k] is job k's
    sampled flag (the HF engine answers greedy and sampled jobs in separate calls)."""
    window = max(1, 4 * batch_size)
    out: list[tuple[int, list[int]]] = []
    for start in range(0, len(todo), window):
        out += sorted(todo[start:start + window], key=lambda x: (flags[x[0]], len(x[1])))
    return out


def generate_shards(model: nn.Module, tokenizer, prompts: list[str], folder: str | Path, s: GenSettings, *,
                    eos_ids: list[int], mask_token_id: int, target_id: str, deadline: float | None = None,
                    shard: tuple[int, int] | None = None, progress=None, start_job: int = 0,
                    max_jobs: int | None = None, report=lambda kind, rec: None, should_stop=None,
                    encoded: list[tuple[int, list[int]]] | None = None) -> GenResult:
    """Answer the jobs [start_job, start_job + max_jobs) (default: one pass over `prompts`) into
    shard files under `folder`; already-stored jobs are skipped (resume). Stops starting new
    batches after `deadline` (time.monotonic()) or once should_stop() is true. Responses
    containing `mask_token_id` are dropped (the first batch runs even past the deadline, so a
    run always has data to train on). shard (i, n): answer only the jobs j = i mod n
    (several workers, disjoint data; the folder is bound to its shard). progress: optional
    callable(done, total); report(kind, record) receives "gen" records with tokens/s.
    encoded: the (prompt index, ids) pairs of `prompts` if already encoded (else encoded here).
    Raises ValueError if the folder holds other settings, the shard is not 0 <= i < n, or no
    prompt fits max_prompt_tokens."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"target": target_id, "settings": asdict(s)}
    if shard is not None:
        if not 0 <= shard[0] < shard[1]:
            raise ValueError(f"prompt shard {shard[0]}/{shard[1]}: need 0 <= i < n")
        doc["shard"] = list(shard)
    _check_manifest(folder, doc)
    pool = encoded if encoded is not None else encode_prompts(tokenizer, prompts, s.max_prompt_tokens)
    if not pool:
        raise ValueError(f"no prompt fits in {s.max_prompt_tokens} tokens")
    n = len(pool)
    flags0 = job_flags(len(prompts), s)
    end = start_job + (n if max_jobs is None else max_jobs)
    done, kept = _done(folder)
    jobs = [j for j in range(start_job, end) if j not in done and (shard is None or j % shard[1] == shard[0])]
    flag = {j: (j >= n or flags0[pool[j % n][0]]) for j in jobs}
    todo = _batch_order([(j, pool[j % n][1]) for j in jobs], flag, s.batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    res = GenResult(next_job=start_job)
    stored, total = len(done), len(done) + len(todo)
    shard_no = len(list(folder.glob("shard_*.pt")))
    answer = Answerer(model, s, pad_id, eos_ids, report)
    t0 = time.monotonic()
    start = 0
    while start < len(todo):
        late = deadline is not None and time.monotonic() > deadline and start > 0  # one batch at least
        if late or (should_stop and should_stop()):
            break
        # generate() is ~10x slower per row: smaller batches keep the deadline checks frequent
        size = s.batch_size if answer.engine == "static" else min(s.batch_size, HF_BATCH_ROWS)
        chunk = todo[start:start + size]
        start += len(chunk)
        tb = time.monotonic()
        responses = answer([p for _, p in chunk], [flag[j] for j, _ in chunk], seed=s.seed * 1_000_003 + chunk[0][0])
        rec = {"index": [j for j, _ in chunk], "sampled": [], "tokens": [], "prompt_lens": [], "lens": []}
        for (j, p), resp in zip(chunk, responses):
            res.new_tokens += len(resp)
            if mask_token_id in resp or not resp:
                continue
            rec["tokens"] += p + resp
            rec["prompt_lens"].append(len(p))
            rec["lens"].append(len(p) + len(resp))
            rec["sampled"].append(flag[j])
            kept += 1
        for key in ("tokens", "prompt_lens", "lens"):
            rec[key] = torch.tensor(rec[key], dtype=torch.int32)
        tmp = folder / f".shard_{shard_no:05d}.pt.tmp"
        torch.save(rec, tmp)
        os.replace(tmp, folder / f"shard_{shard_no:05d}.pt")
        shard_no += 1
        stored += len(chunk)
        res.jobs_done += len(chunk)
        done.update(j for j, _ in chunk)
        now = time.monotonic()
        report("gen", {"done": stored, "total": total, "batch": len(chunk), "engine": answer.engine,
                       "batch_tokens_per_s": round(sum(map(len, responses)) / max(now - tb, 1e-9), 1),
                       "tokens_per_s": round(res.new_tokens / max(now - t0, 1e-9), 1)})
        if progress:
            progress(stored, total)
    res.seconds = time.monotonic() - t0
    res.engine = answer.engine
    # the cursor moves past the last job answered: the jobs of a window cut by the deadline that
    # were not answered (the window's longest prompts) are skipped, not redone by the next piece
    answered = [j for j, _ in todo[:res.jobs_done]]
    res.next_job = max(answered) + 1 if answered else (end if not todo else start_job)
    res.sequences = kept
    return res


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
        if "tokens" in rec:
            pairs = zip(torch.split(rec["tokens"], rec["lens"].tolist()), rec["prompt_lens"].tolist())
        else:  # lists of ids (shards written before the tensor format)
            pairs = ((torch.tensor(p + r), len(p)) for p, r in zip(rec["prompt_ids"], rec["response_ids"]))
        for ids, plen in pairs:
            if min(len(ids), max_len) >= plen + 2:
                out.append(Sequence(ids[:max_len], plen))
    return out
