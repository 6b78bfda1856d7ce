"""bench/tree_batch.py runs on the CPU and reports every (budget, batch) row."""

from __future__ import annotations

from ddtree_server.bench.tree_batch import main, measure


def test_rows_and_table(tmp_path, capsys):
    rows = measure([1, 3], [4], 50, 1, "cpu")
    assert [(r["budget"], r["batch"]) for r in rows] == [(4, 1), (4, 3)]
    assert all(r[k] > 0 for r in rows for k in ("trees_before", "trees_after", "walk_before", "walk_after"))
    assert all(r["walks_equal"] and r["same_trees"] == r["batch"] for r in rows)
    main(["--batch", "2", "--budgets", "3", "--vocab", "40", "--iters", "1", "--device", "cpu",
          "--out", str(tmp_path / "t.json")])
    assert "| budget | batch |" in capsys.readouterr().out and (tmp_path / "t.json").exists()
