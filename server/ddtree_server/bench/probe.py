"""GPU probe of the engine's speed: the numbers that decide which optimisations to build, in one short run.

``ddtree-server probe --out DIR [--budget-s 215]`` (or ``python -m ddtree_server.bench.probe``)

Parts, in this order, each under its own share of the time budget (a part that runs out skips
its remaining items and says so); ``DIR/probe.json`` is rewritten after every part, so a killed
run keeps what it measured:
* ``copy``: device copy bandwidth (read + write);
* ``stages``: the random-shape stage times (bench/random_shape.py) for each shape (default
  qwen3-8b, smollm2-135m), each also written as ``DIR/random-<shape>.{json,md,png}``;
* ``profile``: per-kernel breakdown of one plain step and one DDTree-64 verify at each shape,
  replayed from the CUDA graph and run eagerly through the same static path (bench/probe_kernels.py);
* ``tree``: host tree build (ddtree_builder + tree_inputs) vs the device build of speculative/tree_gpu.py,
  eager and inside a CUDA graph, per call;
* ``gemv``: cuBLAS vs the Triton skinny GEMM at the 8B layer shapes for M = 1, 16, 80;
* ``compile``: torch.compile vs our eager layer / forward (bench/probe_compile.py, own process,
  killed at the deadline; partial results kept).
``--phase2``: the kernel-path probe instead (bench/probe_phase2.py, ``DIR/probe2.json``).
Imports nothing of the API server (no fastapi / pydantic / uvicorn needed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

PARTS = ("copy", "stages", "profile", "tree", "gemv", "compile")
# share of the whole budget each part may use at most (the rest carries over to later parts)
SHARE = {"copy": 0.03, "stages": 0.3, "profile": 0.08, "tree": 0.06, "gemv": 0.15, "compile": 1.0}


class Probe:
    """Holds the deadline and the result document; ``save`` rewrites probe.json."""

    def __init__(self, out: Path, budget_s: float, log=print, name: str = "probe.json"):
        self.out, self.t0, self.budget = out, time.monotonic(), budget_s
        self.log, self.name = log, name
        self.doc: dict = {"parts": {}, "errors": {}}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def part_deadline(self, part: str) -> float:
        return self.deadline(SHARE[part])

    def deadline(self, share: float) -> float:
        """A monotonic deadline ``share`` of the whole budget from now (never past the end)."""
        return time.monotonic() + min(self.left(), share * self.budget)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / self.name).write_text(json.dumps(self.doc, indent=1) + "\n")

    def run_steps(self, steps, summarise, after=lambda: None) -> int:
        """Run ``(name, step)`` parts in order while time is left; a part's result (unless None)
        goes to ``doc["parts"]``, its error to ``doc["errors"]`` (a failing part must not lose the
        others); ``after`` runs after each part; the document is saved after every part, then
        ``summarise(doc)`` is added, saved and printed. Returns 0."""
        for name, step in steps:
            if self.left() < 3:
                self.doc["errors"][name] = "skipped: no time left"
                continue
            t = time.monotonic()
            try:
                result = step()
                if result is not None:
                    self.doc["parts"][name] = result
            except Exception as exc:  # noqa: BLE001
                self.doc["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            after()
            self.doc.setdefault("part_seconds", {})[name] = round(time.monotonic() - t, 1)
            self.save()
            self.log(f"part {name} done in {time.monotonic() - t:.1f} s ({self.left():.0f} s left)")
        self.doc["summary"] = summarise(self.doc)
        self.save()
        print(json.dumps({k: v for k, v in self.doc.items() if k != "parts"}, indent=1))
        return 0


def _profile(engine, shape_name: str, context: int, budget: int) -> dict:
    """Kernel breakdown of a plain step and a DDTree verify, graphed and eager (same static path)."""
    from ddtree_server.bench.probe_kernels import kernel_breakdown
    from ddtree_server.engine import decode
    from ddtree_server.models.dense.graphs import GraphedTarget

    target, dev = engine.target, engine.device
    eager = GraphedTarget(getattr(target, "model", target), capture=False)
    cache = target.new_cache(engine.max_model_len + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (context,), generator=g).to(dev)
    out = {}
    with torch.inference_mode():
        _, feats = target.forward(cache, prompt, torch.arange(context, device=dev), last_only=True)
        one, pos = prompt[-1:], torch.tensor([context], device=dev)
        calls = {"plain_step": lambda t: t.forward(cache, one, pos)}
        if engine.drafter is not None:
            dcache = engine.drafter.new_cache(engine.max_model_len + 1 + engine.drafter.config.block_size)
            logits = engine.drafter.propose(dcache, feats, int(prompt[-1]), context).clone()
            ids, tpos, mask = decode.tree_inputs(decode.ddtree_builder(logits, int(prompt[-1]), budget), context, dev)
            calls[f"verify_ddtree_{budget}"] = lambda t: t.forward(cache, ids, tpos, tree_mask=mask)
        for name, call in calls.items():
            for kind, t in (("graphed", target), ("eager", eager)):
                def fn(t=t, call=call):
                    cache.truncate(context)
                    call(t)
                out[f"{name}/{kind}"] = kernel_breakdown(fn, dev)
    return out


def run_stages_and_profile(p: Probe, shapes: list[str], context: int, iters: int, parts: set[str],
                           tau: dict[str, float]) -> None:
    from ddtree_server.bench import random_report
    from ddtree_server.bench.random_shape import StageOptions, build_engine, run_random_shape
    from ddtree_server.bench.shapes import get_shape

    for i, name in enumerate(shapes):
        deadline = time.monotonic() + min(p.left(), SHARE["stages"] * p.budget / len(shapes))
        if deadline - time.monotonic() < 5:
            p.doc["parts"].setdefault("stages", {})[name] = {"skipped": "time budget"}
            continue
        shape = get_shape(name)
        opts = StageOptions(context=context, iters=iters, deadline=deadline)
        bs = (shape.drafter or {}).get("block_size") or 16
        max_len = context + max((opts.warmup + iters + 2) * bs, max(opts.budgets) + 1 + bs) + 1
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            engine = build_engine(shape, device=device, dtype="bf16" if device == "cuda" else "fp32",
                                  max_len=max_len, tree_budget=max(opts.budgets))
            if "stages" in parts:
                doc = run_random_shape(shape, opts, device=device, engine=engine, log=p.log, tau=tau,
                                       dtype="bf16" if device == "cuda" else "fp32")
                random_report.write(doc, p.out, f"random-{name}")
                p.doc["parts"].setdefault("stages", {})[name] = doc
                p.save()
            if "profile" in parts and p.left() > 10:
                p.doc["parts"].setdefault("profile", {})[name] = _profile(engine, name, context, max(opts.budgets))
                p.save()
        except Exception as exc:  # noqa: BLE001 - one shape failing must not lose the others
            p.doc["errors"][f"stages/{name}"] = f"{type(exc).__name__}: {exc}"[:500]
            p.save()
        engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_tree(p: Probe, deadline: float, iters: int = 50) -> dict:
    """Host vs device tree build per call (ms), budgets 16/32/64, vocab of SmolLM2 and Qwen3."""
    from ddtree_server.bench.timing import time_calls
    from ddtree_server.engine import decode
    from ddtree_server.speculative.tree_gpu import device_tree_inputs

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = {}
    for vocab in (49152, 151936):
        logits = (torch.randn(15, vocab, device=dev) * 4).to(torch.bfloat16)
        for b in (16, 32, 64):
            if time.monotonic() > deadline:
                out[f"v{vocab}/b{b}"] = {"skipped": "time budget"}
                continue
            row = {"host": time_calls(lambda: decode.tree_inputs(decode.ddtree_builder(logits, 7, b), 1024, dev),
                                      iters, 3, dev)["ms"],
                   "device_eager": time_calls(lambda: device_tree_inputs(logits, 7, b, 1024), iters, 3, dev)["ms"]}
            if dev.type == "cuda":
                static = logits.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    device_tree_inputs(static, 7, b, 1024)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    device_tree_inputs(static, 7, b, 1024)
                row["device_graph"] = time_calls(graph.replay, iters, 3, dev)["ms"]
            out[f"v{vocab}/b{b}"] = {k: round(v, 4) for k, v in row.items()}
            p.log(f"tree v{vocab} b{b}: {out[f'v{vocab}/b{b}']}")
    return out


def run_compile(p: Probe) -> list[dict]:
    """bench/probe_compile.py in its own process group, killed 5 s before the probe's end."""
    path = p.out / "compile.jsonl"
    path.unlink(missing_ok=True)
    stop = time.time() + p.left() - 5
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_server.bench.probe_compile", str(path), str(stop)],
                            start_new_session=True)
    try:
        proc.wait(timeout=max(1.0, p.left() - 3))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own child's group: compile workers included
        proc.wait()
        p.doc["errors"]["compile"] = "killed at the probe's deadline (partial results kept)"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ddtree-server probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (probe.json, random-*.md, ...)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall budget of the whole probe (s; default "
                    "215, 260 with --phase2)")
    ap.add_argument("--phase2", action="store_true", help="the kernel-path probe instead (bench/probe_phase2.py; "
                    "copy, attention, stages and profile on/off, exactness); writes probe2.json")
    ap.add_argument("--shapes", default="qwen3-8b,smollm2-135m", help="shapes for stages / profile")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens of the stage timings")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per stage")
    ap.add_argument("--tau", default="ddtree=3.3,dflash=2.2",
                    help="acceptance lengths for the projected speedups (bench --tau syntax)")
    a = ap.parse_args(argv)
    from ddtree_server.bench.random_shape import parse_tau

    try:
        tau = parse_tau(a.tau)
    except ValueError as exc:
        ap.error(str(exc))
    parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; use {','.join(PARTS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    a.budget_s = a.budget_s or (260.0 if a.phase2 else 215.0)
    p = Probe(a.out, a.budget_s, log=lambda s: print(s, flush=True), name="probe2.json" if a.phase2 else "probe.json")
    from ddtree_server.bench.random_report import copy_bandwidth, env_meta

    cuda = torch.cuda.is_available()
    p.doc["meta"] = env_meta("cuda" if cuda else "cpu", "bf16" if cuda else "fp32")
    p.doc["meta"].update(budget_s=a.budget_s, shapes=a.shapes, parts=sorted(parts), context=a.context)
    dev = torch.device("cuda" if cuda else "cpu")
    if a.phase2:
        from ddtree_server.bench.probe_phase2 import run as run_phase2

        return run_phase2(p, a.shapes.split(","), a.context, a.iters, tau)
    steps = [("copy", lambda: copy_bandwidth(dev)),
             ("stages", lambda: run_stages_and_profile(p, a.shapes.split(","), a.context, a.iters, parts, tau)),
             ("tree", lambda: run_tree(p, p.part_deadline("tree"), a.iters)),
             ("gemv", lambda: _gemv(p)),
             ("compile", lambda: run_compile(p) if cuda else {"skipped": "no CUDA"})]
    wanted = [(name, step) for name, step in steps
              if (parts & {"stages", "profile"} if name == "stages" else name in parts)]
    return p.run_steps(wanted, summary)


def summary(doc: dict) -> dict:
    """The decision numbers of a probe document, compact (also printed at the end)."""
    parts, out = doc.get("parts", {}), {}
    out["copy_gbps"] = (parts.get("copy") or {}).get("gbps_read_write")
    for name, d in (parts.get("stages") or {}).items():
        st = d.get("stages") or {}
        ms = lambda k: (st.get(k) or {}).get("ms")  # noqa: E731
        plain = ms("plain_step")
        row = {k: ms(k) for k in ("plain_step", "round_ar", "verify_dflash", "verify_ddtree_64", "draft",
                                  "tree_ddtree_64", "commit_ddtree_64", "round_dflash", "round_ddtree_64")}
        row["plain_pct_of_copy"] = (st.get("forward_1") or {}).get("pct_of_copy")
        if plain:
            row["verify64_over_plain"] = round(ms("verify_ddtree_64") / plain, 3) if ms("verify_ddtree_64") else None
            row["draft_over_plain"] = round(ms("draft") / plain, 3) if ms("draft") else None
        row["break_even_tau"] = (d.get("derived") or {}).get("break_even_tau")
        row["drafter_graphs_enabled"] = (d.get("meta") or {}).get("drafter_graphs_enabled")
        out[f"stages/{name}"] = row
    for name, d in (parts.get("profile") or {}).items():
        out[f"profile/{name}"] = {k: {"kernels": v.get("kernels_per_call"), "kernel_us": v.get("kernel_us_per_call"),
                                      "wall_us": v.get("wall_us_per_call"),
                                      "top3": [t["name"][:60] for t in v.get("top", [])[:3]]}
                                  for k, v in d.items()}
    out["tree_ms"] = parts.get("tree")
    gemv = parts.get("gemv")
    if isinstance(gemv, list):
        out["gemv_gbps"] = {f"{r['shape']}/M{r['m']}": [r.get("cublas_gbps"), r.get("triton_gbps"), r.get("triton_config")]
                            for r in gemv if "skipped" not in r}
    if isinstance(parts.get("compile"), list):
        out["compile"] = [{k: r.get(k) for k in ("part", "shape", "mode", "us_per_layer", "step_ms", "compile_s",
                                                 "first_call_s", "error", "skipped") if r.get(k) is not None}
                          for r in parts["compile"]]
    return out


def _gemv(p: Probe):
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    from ddtree_server.bench.probe_kernels import gemv_bandwidth

    return gemv_bandwidth(p.part_deadline("gemv"), log=p.log)


if __name__ == "__main__":
    sys.exit(main())
