"""The prepared prompt file: gzip (or plain) JSON lines of {"prompt": ...}, written by
``python -m ddtree_server.train.prompts`` for an offline machine and read by training and by the
contamination check."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


def is_prompt_file(path: str | Path) -> bool:
    """True for a ``.jsonl`` / ``.jsonl.gz`` name (a prepared prompt file)."""
    return Path(path).name.endswith((".jsonl", ".jsonl.gz"))


def read_prompt_file(path: str | Path) -> list[str]:
    """The prompts of a ``.jsonl`` / ``.jsonl.gz`` file, in file order."""
    src = Path(path)
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def export_prompts(path: str | Path, prompts: list[str]) -> Path:
    """Write prompts as gzip JSON lines ({"prompt": ...}); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(p, "wt", encoding="utf-8") as fh:
        for text in prompts:
            fh.write(json.dumps({"prompt": text}) + "\n")
    return p
