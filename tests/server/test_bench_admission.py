"""bench.admission: slot bytes grow with the context, the paged estimate admits more than slot-static slots sized
for the model's maximum, and the report is written."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ddtree_server.bench import admission


def test_arithmetic_of_slot_static_and_paged():
    # 1 MiB fixed + 1 KiB per token; 1 GiB budget; model maximum 8192 tokens
    rows = admission.admitted(2 ** 30, [1024, 4096], 8192, lambda n: 2 ** 20 + 1024 * n)
    assert [r["slots"] for r in rows] == [2 ** 30 // (2 ** 20 + 2 ** 20), 2 ** 30 // (2 ** 20 + 4 * 2 ** 20)]
    assert rows[0]["slots_at_model_max"] == 2 ** 30 // (2 ** 20 + 8 * 2 ** 20)
    assert rows[1]["paged"] == rows[1]["slots"] > rows[1]["slots_at_model_max"]


def test_report_on_tiny_shapes(tmp_path):
    for shape in ("tiny", "tiny-hybrid"):
        res = CliRunner().invoke(_app(),
                                 ["--shape", shape, "--contexts", "256,1024", "--device", "cpu", "--dtype", "fp32",
                                  "--free-gib", "1", "--out", str(tmp_path)])
        assert res.exit_code == 0, res.output
        doc = json.loads((tmp_path / f"admission-{shape}.json").read_text())
        small, big = doc["rows"]
        assert 0 < big["slots"] < small["slots"] and big["slot_bytes"] > small["slot_bytes"]
        assert small["paged"] >= small["slots_at_model_max"]


def _app():
    import typer

    app = typer.Typer()
    app.command()(admission.main)
    return app


def test_admission_run_fills_every_slot_and_times_rounds_with_all_decoding(tmp_path):
    """bench.admission_run on the CPU: 5 slots of a tiny hybrid, all 5 requests decoding together
    after the prefill phase (chunks of 64 over 5 prompts of 80 tokens), 3 rounds timed so; and a
    fraction of the free memory gives the slots ``slots_for`` computes (no cap)."""
    from ddtree_server.bench import admission_run

    doc = admission_run.run("tiny-hybrid", 128, 0.5, new_tokens=48, rounds=3, prefill_chunk=64, device="cpu",
                            dtype="fp32", free_gib=1.0, slots=5, log=lambda s: None)
    assert doc["ok"] and doc["error"] is None, doc
    assert doc["slots"] == doc["most_decoding"] == 5 and doc["rounds_timed"] == 3 and doc["round_ms"] > 0
    assert doc["prefill_s"] > 0 and doc["steps"] >= 7   # 400 prompt tokens in chunks of 64, then 3 rounds
    paths = admission_run.write(doc, tmp_path)
    assert "**5 slots**" in paths["md"].read_text() and json.loads(paths["json"].read_text())["slots"] == 5
    per, once = doc["slot_bytes"], doc["round_scratch_bytes"]
    sized = admission_run.slots_for(int(1.0 * 2 ** 30), per, 0.5, cap=1 << 20, once=once)
    assert sized > 64   # the server's default cap does not apply here


def test_admission_run_on_the_paged_layout(tmp_path):
    """``--kv-layout paged`` on the CPU: a tiny hybrid at a max-model-len four times the context,
    5 requests decoding together on pages (the GDN states per slot), rounds timed so."""
    from ddtree_server.bench import admission_run

    doc = admission_run.run("tiny-hybrid", 128, 0.5, new_tokens=48, rounds=3, prefill_chunk=64, device="cpu",
                            dtype="fp32", free_gib=1.0, slots=5, kv_layout="paged", max_model_len=512,
                            log=lambda s: None)
    assert doc["ok"] and doc["most_decoding"] == 5 and doc["rounds_timed"] == 3, doc
    assert doc["kv_layout"] == "paged" and doc["max_model_len"] == 512
    assert doc["kv_pages"] >= 5 * 512 // 16 and doc["page_bytes"] > 0 and doc["slot_bytes"] > 0
