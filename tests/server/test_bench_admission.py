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
