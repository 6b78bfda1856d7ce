"""Benchmark report: per-dataset medians, speedups, verdicts; JSON, markdown and a PNG plot.

Aggregates (per dataset and method, over prompts): median decode tokens/s, median end-to-end
tokens/s, mean and median tau, speedup = median tokens/s of the method / median tokens/s of `ar`
in the same run (T=1 rows are compared with ar at T=0), and for T=0 speculative methods the share
of outputs identical to ar's. Verdicts check the speed targets: tau >= 4 at budget 64 on GSM8K and
HumanEval; ddtree >= 3x ar; ddtree (best budget) faster than dflash.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path


def _median(xs):
    return statistics.median(xs) if xs else None


def aggregate(records: list[dict]) -> dict[str, dict[str, dict]]:
    """{dataset: {method: row}} with n, tokens_per_s, e2e_tokens_per_s, tau, tau_median,
    mean_tokens, speedup, same_as_ar, budget, temperature."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["dataset"], r["method"])].append(r)
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for (ds, method), rs in groups.items():
        same = [r["same_as_ar"] for r in rs if "same_as_ar" in r]
        out[ds][method] = {
            "n": len(rs), "mode": rs[0]["mode"], "budget": rs[0]["budget"], "temperature": rs[0]["temperature"],
            "tokens_per_s": _median([r["tokens_per_s"] for r in rs]),
            "e2e_tokens_per_s": _median([r["tokens"] / r["e2e_s"] for r in rs if r["e2e_s"] > 0]),
            "tau": statistics.fmean(r["tau"] for r in rs), "tau_median": _median([r["tau"] for r in rs]),
            "mean_tokens": statistics.fmean(r["tokens"] for r in rs),
            "same_as_ar": (sum(same) / len(same)) if same and method != "ar" else None,
        }
    for rows in out.values():
        ar = (rows.get("ar") or {}).get("tokens_per_s")
        for row in rows.values():
            row["speedup"] = row["tokens_per_s"] / ar if ar and row["tokens_per_s"] else None
    return dict(out)


TARGETS_HEADING = "## Targets: tau >= 4 at budget 64, ddtree >= 3x ar, ddtree faster than dflash"


def verdicts(agg: dict[str, dict[str, dict]]) -> list[str]:
    """Lines stating which speed targets are met, and by how much they fall short."""
    lines = []
    for ds in ("gsm8k", "humaneval"):
        row = agg.get(ds, {}).get("ddtree-64")
        if row:
            ok = row["tau"] >= 4
            lines.append(f"{ds}: tau at budget 64 = {row['tau']:.2f} ({'met' if ok else 'SHORT of'} target 4)")
    for ds, rows in agg.items():
        trees = {m: r for m, r in rows.items() if r["mode"] == "ddtree" and r["temperature"] == 0 and r["speedup"]}
        if not trees:
            continue
        best = max(trees, key=lambda m: trees[m]["speedup"])
        sp = trees[best]["speedup"]
        line = f"{ds}: best ddtree {best} {sp:.2f}x ar ({'met' if sp >= 3 else 'SHORT of'} target 3x)"
        df = rows.get("dflash", {}).get("speedup")
        if df:
            line += f"; dflash {df:.2f}x -> ddtree {'faster' if sp > df else 'NOT faster'} than dflash"
        lines.append(line)
    return lines


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def markdown(agg: dict, meta: dict, stages: list[dict]) -> str:
    """The markdown report."""
    out = ["# DDTree benchmark", ""]
    out += [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, (dict, list))]
    st = meta.get("settings") or {}
    if st:
        out.append(f"- settings: max_new_tokens {st.get('max_new_tokens')}, budgets {st.get('budgets')}, "
                   f"T=1 budget {st.get('t1_budget')}, hf prompts {st.get('hf_prompts')}, modes {st.get('modes')}")
    out += ["", TARGETS_HEADING, ""] + [f"- {v}" for v in verdicts(agg)]
    for ds, rows in agg.items():
        out += ["", f"## {ds}", "",
                "| method | n | tau (mean) | tokens/s (median, decode) | e2e tokens/s | speedup vs ar | same as ar |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        order = sorted(rows, key=lambda m: (rows[m]["mode"] != "ar", rows[m]["mode"] == "hf-generate",
                                            rows[m]["temperature"], rows[m]["mode"], rows[m]["budget"] or 0))
        for m in order:
            r = rows[m]
            same = "-" if r["same_as_ar"] is None else f"{r['same_as_ar']:.0%}"
            out.append(f"| {m} | {r['n']} | {_fmt(r['tau'])} | {_fmt(r['tokens_per_s'], '.1f')} | "
                       f"{_fmt(r['e2e_tokens_per_s'], '.1f')} | {_fmt(r['speedup'])} | {same} |")
    if stages:
        out += ["", "## Per-stage time of one round (ms, profiling pass with synchronised timers)", "",
                "| dataset | method | tau | draft | tree build | verify | commit + rest | round |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for st in stages:
            ms = st["ms_per_round"]
            name = st["mode"] if st["mode"] != "ddtree" else f"ddtree-{st['budget']}"
            out.append(f"| {st.get('dataset', '-')} | {name} | {st['tau']:.2f} | {ms['draft']:.2f} | {ms['tree']:.2f} "
                       f"| {ms['verify']:.2f} | {ms['commit']:.2f} | {st['round_ms']:.2f} |")
    out += ["", "speedup = median tokens/s of the method / median tokens/s of ar (same run, same prompts); "
            "T=1 rows are compared with ar at T=0; hf-generate = transformers generate() with a static cache "
            "(end-to-end, prefill included; fewer prompts).", ""]
    return "\n".join(out)


def plot(agg: dict, path: Path, title: str) -> Path | None:
    """Speedup and tau vs budget per dataset (dflash as a dashed line); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (ds, rows) in enumerate(sorted(agg.items())):
        color = f"C{i}"
        trees = sorted((r["budget"], r) for m, r in rows.items() if r["mode"] == "ddtree" and r["temperature"] == 0)
        if not trees:
            continue
        xs = [b for b, _ in trees]
        for ax, key in ((axes[0], "speedup"), (axes[1], "tau")):
            ax.plot(xs, [r[key] or 0 for _, r in trees], marker="o", color=color, label=ds)
            df = rows.get("dflash", {}).get(key)
            if df:
                ax.axhline(df, color=color, linestyle="--", linewidth=0.8)
    for ax, label in ((axes[0], "speedup over ar (x)"), (axes[1], "tau (tokens / target forward)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTree budget (nodes)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="dashed: dflash")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(records: list[dict], meta: dict, stages: list[dict], out_dir: str | Path,
                 stem: str = "bench") -> dict[str, Path]:
    """Write `<stem>.json` (meta, aggregates, verdicts, stages, records), `<stem>.md`, `<stem>.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(records)
    doc = {"meta": meta, "aggregate": agg, "verdicts": verdicts(agg), "stages": stages, "records": records}
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    paths["md"].write_text(markdown(agg, meta, stages))
    title = f"{meta.get('gpu', '?')} | torch {meta.get('torch', '?')} | transformers {meta.get('transformers', '?')} " \
            f"| commit {str(meta.get('commit', '?'))[:10]}"
    png = plot(agg, out / f"{stem}.png", title)
    if png:
        paths["png"] = png
    return paths


def save_json_md(doc: dict, lines: list[str], out_dir: str | Path, stem: str) -> dict[str, Path]:
    """``<stem>.json`` (the document) and ``<stem>.md`` (the markdown lines) under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths
