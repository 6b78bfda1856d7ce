"""Phase-2 GPU probe of the engine's speed: the engine's Triton kernel path against the path it replaces.

``PYTHONPATH=server python -m ddtree_server.bench.probe --phase2 --out DIR [--budget-s 260]``

One time-boxed run; ``DIR/probe2.json`` is rewritten after every part, so a killed run keeps what
it measured. The kernel path is switched by ``DDTREE_KERNELS`` (1 = on, 0 = the SDPA / eager-op
path of before), read at every forward.

* ``copy``: device copy bandwidth (read + write);
* ``attention``: one layer's attention, kernel vs SDPA (bench/probe_attention.py), kv lengths
  256 / 1024 / 4096 and N = 1 / 16 / 80, at the qwen3-8b and smollm2-135m head layouts;
* ``stages``: the random-shape stage table (bench/random_shape.py: plain step, verify 16 / 17 /
  33 / 65 rows, draft, tree, commit, rounds) per shape with the kernels on, then off, written as
  ``DIR/random-<shape>-kernels-{on,off}.{json,md,png}``; with each, ``profile``: device kernels
  per forward and their summed time for a plain step and a DDTree-64 verify (graph replays);
* ``exact``: random weights through the engine's decode loops with CUDA graphs: fp32 (smollm2-135m,
  then qwen3-8b) must give ar == dflash == ddtree-16 == ddtree-64 token for token with the kernels
  on (and ar with them off is reported beside); bf16 smollm2-135m reports the "same as ar" share
  per mode, on and off (near-ties may flip in bf16).
``summary`` (also printed) holds the decision numbers.
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch

from ddtree_server.kernels.runtime import ENV

SHARE = {"copy": 0.02, "attention": 0.2, "stages": 0.52, "exact": 1.0}
EXACT_RUNS = (("smollm2-135m", "fp32", 48), ("qwen3-8b", "fp32", 24), ("smollm2-135m", "bf16", 48))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _profile(engine, context: int, budget: int = 64) -> dict:
    """Kernels per forward (graph replay) of a plain step and a DDTree verify of ``budget + 1`` nodes."""
    from ddtree_server.bench.probe_kernels import kernel_breakdown
    from ddtree_server.engine import decode

    target, dev = engine.target, engine.device
    cache = target.new_cache(engine.max_model_len + 1)
    prompt = torch.randint(0, target.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.inference_mode():
        _, feats = target.forward(cache, prompt.to(dev), torch.arange(context, device=dev), last_only=True)
        one, pos = prompt[-1:].to(dev), torch.tensor([context], device=dev)
        dcache = engine.drafter.new_cache(engine.max_model_len + 1 + engine.drafter.config.block_size)
        logits = engine.drafter.propose(dcache, feats, int(prompt[-1]), context).clone()
        ids, tpos, mask = decode.tree_inputs(decode.ddtree_builder(logits, int(prompt[-1]), budget), context, dev)
        calls = {"plain_step": lambda: target.forward(cache, one, pos),
                 f"verify_ddtree_{budget}": lambda: target.forward(cache, ids, tpos, tree_mask=mask),
                 "draft": lambda: engine.drafter.propose(dcache, feats[-4:], int(prompt[-1]), context)}
        for name, call in calls.items():
            def fn(call=call):
                cache.truncate(context)
                dcache.crop(context - 4)
                call()
            r = kernel_breakdown(fn, dev, top=8)
            out[name] = {k: r[k] for k in ("kernels_per_call", "kernel_us_per_call", "wall_us_per_call")}
            out[name]["top"] = [(t["name"][:70], t["calls_per_call"], t["us_per_call"]) for t in r["top"]]
    return out


def _dev_dtype() -> tuple[str, str]:
    return ("cuda", "bf16") if torch.cuda.is_available() else ("cpu", "fp32")


def stages_part(p, shapes: list[str], context: int, iters: int, tau: dict) -> dict:
    """Stage tables and profiles per shape, kernels on then off (one engine per shape)."""
    from ddtree_server.bench import random_report
    from ddtree_server.bench.random_shape import StageOptions, build_engine, run_random_shape
    from ddtree_server.bench.shapes import get_shape

    out: dict = {}
    end = time.monotonic() + min(p.left(), SHARE["stages"] * p.budget)
    for i, name in enumerate(shapes):
        shape = get_shape(name)
        bs = (shape.drafter or {}).get("block_size") or 16
        opts = StageOptions(context=context, iters=iters)
        max_len = context + max((opts.warmup + iters + 2) * bs, max(opts.budgets) + 1 + bs) + 1
        dev, dtype = _dev_dtype()
        engine = build_engine(shape, device=dev, dtype=dtype, max_len=max_len, tree_budget=max(opts.budgets))
        for flag, label in (("1", "on"), ("0", "off")):
            share = (end - time.monotonic()) / (2 * (len(shapes) - i) - (label == "off"))
            if share < 5:
                out.setdefault(name, {})[label] = {"skipped": "time budget"}
                continue
            os.environ[ENV] = flag
            opts = StageOptions(context=context, iters=iters, deadline=time.monotonic() + share)
            try:
                doc = run_random_shape(shape, opts, device=dev, dtype=dtype, engine=engine, log=p.log, tau=tau)
                doc["meta"]["kernels"] = label
                random_report.write(doc, p.out, f"random-{name}-kernels-{label}")
                doc["profile"] = _profile(engine, context)
            except Exception as exc:  # noqa: BLE001 - one failing run must not lose the others
                doc = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            out.setdefault(name, {})[label] = doc
            p.doc["parts"]["stages"] = out
            p.save()
        os.environ.pop(ENV, None)
        engine = None
        _free()
    return out


def _tokens(engine, cache, dcache, prompt: list[int], mode: str, budget: int, count: int) -> tuple[list[int], float]:
    from ddtree_server.engine import decode
    from ddtree_server.engine.sampling import SamplingParams, TokenChooser

    dev = engine.device
    chooser = TokenChooser(SamplingParams(max_tokens=count), dev)
    cache.reset()
    dcache.crop(0)
    if mode == "ar":
        gen = decode.ar_loop(engine.target, cache, prompt, chooser, dev)
    else:
        build = decode.dflash_builder if mode == "dflash" else decode.ddtree_builder
        gen = decode.spec_loop(engine.target, engine.drafter, cache, dcache, prompt, chooser, dev, build, budget)
    out, rounds = [], 0
    with torch.inference_mode():
        for toks in gen:
            out += toks
            rounds += 1
            if len(out) >= count:
                break
    gen.close()
    return out[:count], round((len(out) - 1) / max(1, rounds - 1), 3)


def exact_part(p, runs=EXACT_RUNS, context: int = 700) -> list[dict]:
    """Token equality of the decode modes on random weights (see module docstring); runs:
    (shape, dtype, tokens) triples."""
    from ddtree_server.bench.random_shape import build_engine
    from ddtree_server.bench.shapes import get_shape

    rows = []
    for name, dtype, count in runs:
        row = {"shape": name, "dtype": dtype, "tokens": count, "context": context}
        if p.left() < (60 if name == "qwen3-8b" else 10):
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            shape = get_shape(name)
            engine = build_engine(shape, device=_dev_dtype()[0], dtype=dtype, max_len=context + count + 200,
                                  tree_budget=64)
            cache = engine.target.new_cache(engine.max_model_len + 1)
            dcache = engine.drafter.new_cache(engine.max_model_len + 1 + engine.drafter.config.block_size)
            prompt = torch.randint(0, shape.target["vocab_size"], (context,),
                                   generator=torch.Generator().manual_seed(1)).tolist()
            got, tau = {}, {}
            for flag, label in (("1", "on"), ("0", "off")):
                os.environ[ENV] = flag
                for mode, budget in (("ar", 0), ("dflash", engine.block_size - 1), ("ddtree", 16), ("ddtree", 64)):
                    key = f"{mode}{'-' + str(budget) if mode == 'ddtree' else ''}/{label}"
                    got[key], tau[key] = _tokens(engine, cache, dcache, prompt, mode, budget, count)
            ar_on, ar_off = got["ar/on"], got["ar/off"]
            row["same_as_ar"] = {k: v == (ar_on if k.endswith("/on") else ar_off) for k, v in got.items()}
            row["first_diff"] = {k: next((i for i, (a, b) in enumerate(zip(v, ar_on if k.endswith("/on") else ar_off))
                                          if a != b), None) for k, v in got.items()}
            row["ar_on_equals_ar_off"] = ar_on == ar_off
            row["tau"] = tau
            row["all_equal_on"] = all(v for k, v in row["same_as_ar"].items() if k.endswith("/on"))
            row["drafter_graphs_enabled"] = getattr(engine.drafter, "enabled", None)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        os.environ.pop(ENV, None)
        p.log(f"exact {name} {dtype}: {json.dumps({k: row.get(k) for k in ('all_equal_on', 'ar_on_equals_ar_off', 'error')})}")
        rows.append(row)
        engine = cache = dcache = None
        _free()
    return rows


def summary(doc: dict) -> dict:
    """Decision numbers: stage medians on / off, ratios, kernels per forward, attention, exactness."""
    parts, out = doc.get("parts", {}), {"copy_gbps": (doc["parts"].get("copy") or {}).get("gbps_read_write")}
    for name, by_flag in (parts.get("stages") or {}).items():
        for label, d in by_flag.items():
            st = d.get("stages") or {}
            ms = lambda k: (st.get(k) or {}).get("ms")  # noqa: E731
            plain = ms("plain_step")
            row = {k: ms(k) for k in ("plain_step", "verify_dflash", "verify_ddtree_16", "verify_ddtree_64", "draft",
                                      "tree_ddtree_64", "commit_ddtree_64", "round_ar", "round_ddtree_64")}
            row["plain_pct_of_copy"] = (st.get("plain_step") or {}).get("pct_of_copy")
            if plain:
                row["tok_per_s_plain"] = round(1000 / plain, 1)
                for k, short in (("verify_ddtree_64", "verify64"), ("draft", "draft"), ("round_ddtree_64", "round64")):
                    row[f"{short}_over_plain"] = round(ms(k) / plain, 3) if ms(k) else None
            prof = d.get("profile") or {}
            row["kernels_per_forward"] = {k: v.get("kernels_per_call") for k, v in prof.items()}
            row["error"], row["skipped_stages"] = d.get("error"), d.get("skipped") or None
            out[f"stages/{name}/{label}"] = {k: v for k, v in row.items() if v is not None}
    att = [r for r in parts.get("attention") or [] if "kernel_us" in r and "config" not in r]
    out["attention"] = {f"{r['shape']}/s{r['s']}/N{r['n']}": [r["sdpa_us"], r["kernel_us"], r["speedup"],
                                                             r["max_abs_diff"]] for r in att}
    out["exact"] = [{k: r.get(k) for k in ("shape", "dtype", "all_equal_on", "ar_on_equals_ar_off", "same_as_ar",
                                           "drafter_graphs_enabled", "error", "skipped") if r.get(k) is not None}
                    for r in parts.get("exact") or []]
    return out


def run(p, shapes: list[str], context: int, iters: int, tau: dict) -> int:
    """All parts in order under the probe's budget; writes DIR/probe2.json; returns 0."""
    from ddtree_server.bench.probe_attention import attention_part
    from ddtree_server.bench.random_report import copy_bandwidth

    p.doc["meta"].update(phase=2, parts=["copy", "attention", "stages", "exact"])
    dev = torch.device(_dev_dtype()[0])
    cuda = dev.type == "cuda"  # on CPU (tests, TRITON_INTERPRET=1): no attention timing, tiny exact runs
    steps = [("copy", lambda: copy_bandwidth(dev)),
             ("attention", lambda: attention_part(p.deadline(SHARE["attention"]), shapes, log=p.log) if cuda
              else {"skipped": "no CUDA"}),
             ("stages", lambda: stages_part(p, shapes, context, iters, tau)),
             ("exact", lambda: exact_part(p, EXACT_RUNS if cuda else [(s, "fp32", 6) for s in shapes],
                                          700 if cuda else context))]
    return p.run_steps(steps, summary, after=lambda: os.environ.pop(ENV, None))
