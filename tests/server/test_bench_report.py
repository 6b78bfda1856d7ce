"""Benchmark aggregation, verdicts and report files on hand-made records (no models)."""

from __future__ import annotations

import json

from ddtree_server.bench.report import aggregate, verdicts, write_report
from ddtree_server.bench.runner import BenchSettings, Method, methods_for
from ddtree_server.bench.session import merge_reports


def _rec(ds, method, mode, budget, tps, tau, temperature=0.0, same=None):
    r = {"dataset": ds, "prompt_id": "p", "method": method, "mode": mode, "budget": budget,
         "temperature": temperature, "tokens": 100, "rounds": int(100 / tau), "tau": tau, "decode_s": 100 / tps,
         "prefill_s": 0.01, "e2e_s": 100 / tps + 0.01, "tokens_per_s": tps}
    if same is not None:
        r["same_as_ar"] = same
    return r


RECORDS = [
    _rec("gsm8k", "ar", "ar", None, 100, 1.0), _rec("gsm8k", "ar", "ar", None, 120, 1.0),
    _rec("gsm8k", "dflash", "dflash", None, 250, 3.0, same=True),
    _rec("gsm8k", "ddtree-64", "ddtree", 64, 330, 4.5, same=True),
    _rec("gsm8k", "ddtree-64", "ddtree", 64, 330, 4.1, same=False),
    _rec("gsm8k", "ddtree-64@T1", "ddtree", 64, 200, 3.0, temperature=1.0),
    _rec("humaneval", "ar", "ar", None, 100, 1.0), _rec("humaneval", "ddtree-64", "ddtree", 64, 200, 3.5, same=True),
    _rec("humaneval", "dflash", "dflash", None, 250, 3.0, same=True),
]


def test_aggregate_medians_and_speedups():
    agg = aggregate(RECORDS)
    g = agg["gsm8k"]
    assert g["ar"]["tokens_per_s"] == 110 and g["ar"]["n"] == 2
    assert abs(g["ddtree-64"]["speedup"] - 3.0) < 1e-9 and abs(g["ddtree-64"]["tau"] - 4.3) < 1e-9
    assert g["ddtree-64"]["same_as_ar"] == 0.5 and g["ar"]["same_as_ar"] is None


def test_verdicts_name_shortfalls():
    text = "\n".join(verdicts(aggregate(RECORDS)))
    assert "gsm8k: tau at budget 64 = 4.30 (met target 4)" in text
    assert "humaneval: tau at budget 64 = 3.50 (SHORT of target 4)" in text
    assert "gsm8k: best ddtree ddtree-64 3.00x ar (met target 3x); dflash 2.27x -> ddtree faster" in text
    assert "humaneval: best ddtree ddtree-64 2.00x ar (SHORT of target 3x); dflash 2.50x -> ddtree NOT faster" in text


def test_files_and_merge(tmp_path):
    stages = [{"dataset": "gsm8k", "mode": "ddtree", "budget": 64, "tau": 4.0, "rounds": 10, "round_ms": 10.0,
               "ms_per_round": {"draft": 2.0, "tree": 1.0, "verify": 6.0, "commit": 1.0}}]
    a = write_report(RECORDS[:6], {"gpu": "X", "commit": "abc"}, stages, tmp_path / "a")
    b = write_report(RECORDS[6:], {"gpu": "X", "commit": "abc"}, [], tmp_path / "b")
    md = a["md"].read_text()
    assert "| ddtree-64 | 2 | 4.30 |" in md and "| gsm8k | ddtree-64 | 4.00 | 2.00 | 1.00 | 6.00 | 1.00 | 10.00 |" in md
    merged = merge_reports([a["json"], b["json"]], tmp_path / "m")
    doc = json.loads(merged["json"].read_text())
    assert set(doc["aggregate"]) == {"gsm8k", "humaneval"} and len(doc["records"]) == len(RECORDS)


def test_method_list():
    names = [m.name for m in methods_for(BenchSettings(budgets=(16, 64)), True)]
    assert names == ["ar", "dflash", "ddtree-16", "ddtree-64", "ddtree-64@T1"]
    assert [m.name for m in methods_for(BenchSettings(), False)] == ["ar"]
    assert Method("ddtree", 32, 1.0).name == "ddtree-32@T1"


class _FakeEngine:
    """Engine stand-in for BenchRun's bookkeeping: every request yields 4 tokens in 2 rounds."""

    spec_available = True

    def encode(self, text, chat=True):
        return [ord(c) for c in text]

    def generate(self, ids, params, mode=None, tree_budget=None):
        from ddtree_server.engine.engine import DecodeStats, GenerationEvent

        stats = DecodeStats(mode=mode, tree_budget=tree_budget, block_size=None, decode_rounds=2,
                            generated_tokens=4, mean_acceptance_length=1.5, prefill_seconds=0.001,
                            decode_seconds=0.002, tokens_per_second=1500.0, decode_tokens=3)
        yield GenerationEvent([1, 2, 3, 4], "abcd", "length", stats)


def test_runner_interleaves_datasets_and_stops_on_time_budget():
    from ddtree_server.data.datasets import BenchPrompt
    from ddtree_server.bench.runner import BenchRun, BenchSettings

    prompts = {"a": [BenchPrompt("a", f"a{i}", f"x{i}") for i in range(3)],
               "b": [BenchPrompt("b", f"b{i}", f"y{i}") for i in range(1)]}
    settings = BenchSettings(budgets=(8,), t1_budget=None, hf_prompts=0)
    recs = BenchRun(_FakeEngine(), settings, lambda r: None).run(prompts)
    assert [r["prompt_id"] for r in recs if r["method"] == "ar"] == ["a0", "b0", "a1", "a2"]
    assert {r["method"] for r in recs} == {"ar", "dflash", "ddtree-8"} and all(r.get("same_as_ar", True) for r in recs)
    cut = BenchRun(_FakeEngine(), BenchSettings(budgets=(8,), t1_budget=None, hf_prompts=0, time_budget_s=-1.0),
                   lambda r: None).run(prompts)
    assert cut == []
