"""``bench --concurrency C[,C2...]``: closed-loop serving throughput of the batch engine.

For each decoding method and concurrency C, C requests are kept in flight over the prompt sets
(a finished request is replaced by the next prompt at once, as ``dflash.benchmark
--concurrency`` does) through the server's batch engine in this process (no HTTP). Reported:
aggregate output tokens/s (all tokens / wall time), p50 / p99 time per output token of the
requests ((finish - first token) / (tokens - 1)), mean acceptance length, and the ratio to
plain decoding at the same C. Methods: ``ar``, ``dflash``, ``ddtree`` (each request's mode as
given), ``policy`` (ddtree under ``--spec-policy auto``) and ``gate`` (ddtree under the
speculation gate, ``--spec-gate on``: a fresh gate per run, so its warm-up is in the figures).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def closed_loop(engine, prompts: list[list[int]], *, mode: str, budget: int | None, concurrency: int,
                max_new_tokens: int, temperature: float = 0.0) -> dict:
    """Run every prompt once, ``concurrency`` at a time; returns the aggregate record."""
    from ddtree_server.engine.batch.gate import SpecGate
    from ddtree_server.engine.sampling import SamplingParams

    batch, todo = engine.batch, list(enumerate(prompts))
    saved, batch.gate = batch.gate, SpecGate() if mode == "gate" else None
    live: dict[str, dict] = {}
    done: list[dict] = []
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            i, ids = todo.pop(0)
            req = engine.make_request(ids, SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                                          seed=i), mode="ddtree" if mode in ("policy", "gate") else mode,
                                      tree_budget=budget, rid=str(i),
                                      spec_policy="auto" if mode == "policy" else "fixed")
            batch.add(req)
            live[req.rid] = {"start": time.perf_counter(), "first": None, "tokens": 0}
        for req, ev in batch.step():
            req.events.clear()
            rec = live[req.rid]
            now = time.perf_counter()
            rec["first"] = rec["first"] or now
            rec["tokens"] += len(ev.token_ids)
            if ev.finish_reason is not None:
                rec.update(end=now, tau=ev.stats.mean_acceptance_length if ev.stats else None)
                done.append(live.pop(req.rid))
    wall = time.perf_counter() - t0
    gate, batch.gate = batch.gate, saved
    plain_share = round(gate.decisions[False] / max(sum(gate.decisions.values()), 1), 3) if gate else None
    tokens = sum(r["tokens"] for r in done)
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    taus = [r["tau"] for r in done if r["tau"]]
    return {"mode": mode, "budget": budget, "concurrency": concurrency, "requests": len(done),
            "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "tpot_p50_ms": round(1e3 * _pct(tpot, 0.5), 2) if tpot else None,
            "tpot_p99_ms": round(1e3 * _pct(tpot, 0.99), 2) if tpot else None,
            "mean_tau": round(statistics.mean(taus), 3) if taus else None, "gate_plain_share": plain_share}


def run(engine, prompts: list[list[int]], concurrencies: list[int], methods: list[tuple[str, int | None]],
        max_new_tokens: int, log: Callable[[str], None] = print) -> list[dict]:
    """Every (method, C) pair, after one untimed warm-up request per method."""
    rows = []
    for mode, budget in methods:
        closed_loop(engine, prompts[:1], mode=mode, budget=budget, concurrency=1, max_new_tokens=8)
        for c in concurrencies:
            row = closed_loop(engine, prompts, mode=mode, budget=budget, concurrency=c,
                              max_new_tokens=max_new_tokens)
            rows.append(row)
            log(f"{mode}{'' if budget is None else f'-{budget}'} C={c}: {row['tokens_per_s']} tok/s, "
                f"TPOT p50 {row['tpot_p50_ms']} ms, tau {row['mean_tau']}"
                + ("" if row["gate_plain_share"] is None else f", plain rounds {row['gate_plain_share']}"))
    for row in rows:
        plain = next((r for r in rows if r["mode"] == "ar" and r["concurrency"] == row["concurrency"]), None)
        row["x_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3) if plain else None
    return rows


def write(rows: list[dict], meta: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """``<stem>.json`` and ``<stem>.md`` under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Closed-loop concurrency, {meta.get('model')} on {meta.get('device')} {meta.get('dtype')}, "
             f"{meta.get('prompts')} prompts, {meta.get('max_new_tokens')} new tokens", "",
             "| method | C | tokens/s | x plain | TPOT p50 ms | TPOT p99 ms | tau | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        name = r["mode"] + ("" if r["budget"] is None else f"-{r['budget']}")
        lines.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']} | {r['x_plain']} | {r['tpot_p50_ms']} | "
                     f"{r['tpot_p99_ms']} | {r['mean_tau']} | {r['wall_s']} |")
    paths["md"].write_text("\n".join(lines) + "\n")
    return paths
