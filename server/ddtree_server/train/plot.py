"""Plot a drafter training log (train_log.jsonl) as one PNG.

`python -m ddtree_server.train.plot LOG.jsonl [LOG2.jsonl ...] --out train_log.png`

Panels: training loss (and validation loss) over steps; validation chain tau over steps; the
validation acceptance per in-block position k (share of blocks whose leading run of correct drafts
reaches k, so tau = 1 + its sum) at the first and the last validation of every run; and the
validation top-1 accuracy per position over steps for a few positions. Dashed vertical lines mark
where a run (a resumed piece) starts. Older logs without a `kind` field (training records carry
`loss`, the final validation record `val_loss`) are read too; several logs are read as one in the
order given. Needs matplotlib (the server's `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_log(paths: list[str | Path]) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of one or more logs, in order."""
    train, val = [], []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("kind") or ("train" if "loss" in rec else "val" if "val_loss" in rec else None)
            if kind == "train":
                train.append(rec)
            elif kind == "val":
                val.append(rec)
    return train, val


def _smooth(ys: list[float], k: int = 10) -> list[float]:
    """Trailing mean over the last k values (batch records are noisy)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(paths: list[str | Path], out: str | Path) -> Path:
    """Write the PNG; returns its path. Raises ValueError for a log with no training record and
    ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = read_log(paths)
    if not train:
        raise ValueError(f"{', '.join(map(str, paths))}: no training record")
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    (a_loss, a_tau), (a_pos, a_acc) = ax
    steps = [r["step"] for r in train]
    a_loss.plot(steps, [r["loss"] for r in train], lw=0.5, alpha=0.4, label="train loss (batch)")
    a_loss.plot(steps, _smooth([r["loss"] for r in train]), lw=1.2, c="C0", label="train loss (mean of 10)")
    if val:
        a_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", ms=3, label="validation loss")
    a_loss.set(xlabel="step", ylabel="weighted CE (nats)", title="loss")
    tt = [r for r in train if r.get("tau")]
    a_tau.plot([r["step"] for r in tt], [r["tau"] for r in tt], lw=0.5, alpha=0.3, c="C0", label="train chain tau (batch)")
    a_tau.plot([r["step"] for r in tt], _smooth([r["tau"] for r in tt]), lw=1.2, c="C0", label="train (mean of 10)")
    vt = [r for r in val if r.get("val_tau") is not None]
    a_tau.plot([r["step"] for r in vt], [r["val_tau"] for r in vt], "o-", ms=3, label="validation chain tau")
    a_tau.set(xlabel="step", ylabel="tau (block of 16, greedy chain)", title="acceptance length")
    runs = sorted({r.get("run", 0) for r in train + val})
    for run in runs[1:]:
        first = min(r["step"] for r in train + val if r.get("run", 0) == run)
        for a in (a_loss, a_tau, a_acc):
            a.axvline(first, ls="--", c="grey", lw=0.8)
    for run in runs:
        mine = [r for r in val if r.get("run", 0) == run and (r.get("val_accept") or r.get("val_acc"))]
        for rec, style in ((mine[0], ":"), (mine[-1], "-")) if len(mine) > 1 else ((mine[0], "-"),) if mine else ():
            ys = rec.get("val_accept") or rec["val_acc"]
            what = "accept" if rec.get("val_accept") else "top-1 acc"
            a_pos.plot(range(1, len(ys) + 1), ys, style, marker=".", label=f"run {run} step {rec['step']} ({what})")
    a_pos.set(xlabel="in-block position k", ylabel="share of blocks", title="validation, per position")
    with_acc = [r for r in val if r.get("val_acc")]
    if with_acc:
        width = len(with_acc[-1]["val_acc"])
        for k in sorted({1, 2, 4, 8, width}):
            a_acc.plot([r["step"] for r in with_acc], [r["val_acc"][k - 1] for r in with_acc], "o-", ms=3, label=f"k={k}")
    a_acc.set(xlabel="step", ylabel="top-1 accuracy", title="validation accuracy at position k")
    for a in (a_loss, a_tau, a_pos, a_acc):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="train_log.jsonl file(s), oldest first")
    ap.add_argument("--out", required=True, help="PNG to write")
    args = ap.parse_args(argv)
    try:
        print(plot(args.logs, args.out))
    except (ValueError, OSError) as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
