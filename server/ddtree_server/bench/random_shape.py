"""Per-stage times of the engine at a named model shape with random weights (`bench --random-shape`).

The target and its drafter are built on the device from `bench/shapes.py` with random weights
(`models.random_init.target_from_config`, `drafter_from_config`) and wrapped by the
server's `Engine` (on CUDA: `GraphedTarget` / `GraphedDrafter`). A prompt of random token ids fills
the KV cache to `context` tokens. Each stage is then timed call by call through the engine's own
code (`engine/decode.py`'s builders and loops, `KVCache.keep`, `speculative/walk.py`), synchronising the
device before and after every call, and summarised by the median (and p10 / p90) of `iters` calls:

* `forward_1` (one-token target forward) and `plain_step` (forward + greedy choice, as `ar_loop`);
* `verify_dflash` (16-token chain) and `verify_ddtree_B` (B + 1 nodes, ancestor mask);
* `draft` (drafter proposal after `ctx_rows` new context rows), `tree_ddtree_B` / `tree_dflash`
  (builders), `tree_inputs_B` (ids / positions / mask to the device);
* `commit_ddtree_B`: greedy choice of the verify logits, walk along a fixed 4-node path of the tree
  (random weights rarely accept anything, so the path is set, not found), `KVCache.keep` and the
  feature gather, as `spec_loop` does;
* `round_ar`, `round_dflash`, `round_ddtree_B`: one `next()` of the real decode generators (the
  whole round; no detokenisation or stop checks, which the Engine adds);
* graphed dense targets: `device_round_B`, `round_ddtree_B_device`, `round_ddtree_B_host` (the batch-1
  device round and the step runner's rounds with and without it: bench/solo_stages.py).

With random weights acceptance is ~1 token a round, so rounds see 1 new context row: the
isolated `draft` stage uses `ctx_rows` (default 4, about a real tau) instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ddtree_server.bench import solo_stages
from ddtree_server.bench.shapes import Shape
from ddtree_server.bench.timing import time_calls


@dataclass
class StageOptions:
    """What to time (tokens, calls)."""

    context: int = 1024                      # cached tokens before the timed calls
    iters: int = 50                          # timed calls per stage (median over them)
    warmup: int = 3                          # untimed calls first (graph capture, autotuning)
    budgets: tuple[int, ...] = (16, 32, 64)  # DDTree budgets (B + 1 nodes)
    ctx_rows: int = 4                        # new context rows of the isolated draft stage
    seed: int = 0
    deadline: float | None = None            # time.monotonic() after which stages are skipped
    skipped: list[str] = field(default_factory=list)


def resolve_device(device: str = "auto", dtype: str | None = None) -> tuple[str, str]:
    """('cuda' | 'cpu' | given, 'bf16' on CUDA / 'fp32' on CPU unless given)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, dtype or ("bf16" if device.startswith("cuda") else "fp32")


def random_models(shape: Shape, *, device: str, dtype: str):
    """(target, drafter or None) with random weights at ``shape`` (the drafter seeded 1)."""
    from ddtree_server.models.random_init import drafter_from_config, target_from_config

    target = target_from_config(shape.target, device=device, dtype=dtype)
    drafter = None
    if shape.drafter is not None:
        drafter = drafter_from_config(shape.drafter, target, device=device, dtype=dtype, seed=1)
    return target, drafter


def build_engine(shape: Shape, *, device: str, dtype: str, max_len: int, tree_budget: int = 64,
                 max_running: int = 1, kv_layout: str = "slot", kv_pages: int | None = None):
    """The server's Engine over a random target (+ drafter) of ``shape``; no tokenizer;
    ``max_running`` slots in its batch engine; ``kv_layout`` / ``kv_pages``: as ``Engine``'s."""
    from ddtree_server.engine.engine import Engine

    target, drafter = random_models(shape, device=device, dtype=dtype)
    return Engine(target, None, drafter, model_id=shape.name, max_model_len=max_len, eos_token_ids=[],
                  tree_budget=tree_budget, max_running=max_running, kv_layout=kv_layout, kv_pages=kv_pages)


def kv_window(target, cache, s: int, n: int) -> int:
    """Key rows attention reads for ``n`` new tokens after ``s`` cached ones: as
    ``GraphedTarget.kv_rows`` on the graphed path (the live rows with the kernels, else a
    power-of-two window), else s + n."""
    from ddtree_server.models.dense.graphs import GraphedTarget

    rows = target.kv_rows(cache, s, n) if isinstance(target, GraphedTarget) else None
    return s + n if rows is None else rows


def rewind(cache, s: int) -> None:
    """Back to ``s`` cached rows before a timed call: ``KVCache.truncate``. A hybrid cache drops
    its pending (uncommitted) block instead; rows it committed stay, since recurrent states cannot
    be rolled back, so its length only grows by the timed single-token steps (a few dozen rows on
    top of the context: the timings do not depend on it)."""
    if not hasattr(cache, "pending"):
        cache.truncate(s)
    elif cache.pending is not None:
        cache.keep(cache.pending[0], [])


def _path_choices(tree, length: int = 4) -> tuple[list[int], list[int]]:
    """A root-first path of up to ``length`` nodes towards the deepest, last-added node (so its
    rows are usually not contiguous) and target choices that make ``walk`` follow it."""
    node = max(range(tree.size), key=lambda i: (tree.depths[i], i))
    chain = [node]
    while chain[-1] != 0:
        chain.append(tree.parents[chain[-1]])
    path = chain[::-1][:length]
    choices = [-1] * tree.size
    for a, b in zip(path, path[1:]):
        choices[a] = tree.tokens[b]
    return path, choices


def measure(engine, opts: StageOptions, log: Callable[[str], None] = lambda s: None) -> dict:
    """Time every stage (see module docstring); returns {stage: {ms, p10, p90, n, rows, kv_len}}."""
    from ddtree_server.engine import decode
    from ddtree_server.engine.sampling import SamplingParams, TokenChooser
    from ddtree_server.speculative.walk import accepted_tokens, walk

    target, drafter, dev = engine.target, engine.drafter, engine.device
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(opts.seed)
    prompt = torch.randint(0, vocab, (opts.context,), generator=g).tolist()
    s, bonus = opts.context, int(prompt[-1])
    cache = target.new_cache(engine.max_model_len + 1)
    chooser = TokenChooser(SamplingParams(max_tokens=1), dev)
    out: dict[str, dict] = {}

    def run(name: str, fn, setup=None, rows: int = 1, kv: int | None = None):
        if opts.deadline is not None and time.monotonic() > opts.deadline:
            opts.skipped.append(name)
            return
        r = time_calls(fn, opts.iters, opts.warmup, dev, setup)
        out[name] = {**{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, "rows": rows,
                     "kv_len": kv if kv is not None else kv_window(target, cache, s, rows)}
        log(f"{name}: {r['ms']:.3f} ms")

    with torch.inference_mode():
        ids = torch.tensor(prompt, device=dev)
        _, feats = target.forward(cache, ids, torch.arange(s, device=dev), last_only=True)
        one_id, one_pos = torch.tensor([bonus], device=dev), torch.tensor([s], device=dev)
        reset = lambda: rewind(cache, s)  # noqa: E731
        run("forward_1", lambda: target.forward(cache, one_id, one_pos), reset)
        run("plain_step", lambda: chooser.choose(target.forward(cache, one_id, one_pos)[0]), reset)
        if drafter is not None:
            _spec_stages(engine, opts, cache, feats, prompt, run, out, decode, chooser, walk, accepted_tokens)
        # whole rounds through the real decode generators (they prefill the prompt themselves)
        loops = {"round_ar": lambda: decode.ar_loop(target, cache, prompt, chooser, dev)}
        if drafter is not None:
            dcache = drafter.new_cache(engine.max_model_len + 1 + drafter.config.block_size)
            bs = drafter.config.block_size
            loops["round_dflash"] = lambda: decode.spec_loop(target, drafter, cache, dcache, prompt, chooser, dev,
                                                             decode.dflash_builder, bs - 1)
            for b in opts.budgets:
                loops[f"round_ddtree_{b}"] = (lambda b=b: decode.spec_loop(
                    target, drafter, cache, dcache, prompt, chooser, dev, decode.ddtree_builder, b))
        for name, make in loops.items():
            if opts.deadline is not None and time.monotonic() > opts.deadline:
                opts.skipped.append(name)
                continue
            cache.reset()
            if drafter is not None:
                dcache.crop(0)
            gen = make()
            next(gen)  # prefill
            run(name, lambda: next(gen))
            gen.close()
        if drafter is not None:   # last: they run on the runner's slot cache (bench/solo_stages.py)
            solo_stages.runner_round_stages(engine, opts.budgets, prompt, run)
    return out


def _spec_stages(engine, opts, cache, feats, prompt, run, out, decode, chooser, walk, accepted_tokens) -> None:
    """Draft, tree build, tree inputs, verify and commit stages (drafter present)."""
    target, drafter, dev = engine.target, engine.drafter, engine.device
    s, bonus, r = opts.context, int(prompt[-1]), opts.ctx_rows
    bs = drafter.config.block_size
    dcache = drafter.new_cache(engine.max_model_len + 1 + bs)
    drafter.propose(dcache, feats[: s - r], bonus, s - r)  # the context the drafter has seen
    new_ctx = feats[s - r:s].clone()
    held: dict = {}

    def draft():
        held["logits"] = drafter.propose(dcache, new_ctx, bonus, s)

    graphed = type(drafter).__name__ == "GraphedDrafter"
    kv = min(max(256, 1 << (s + bs - 1).bit_length()), dcache.max_len) if graphed else s + bs
    run("draft", draft, lambda: dcache.crop(s - r), rows=r, kv=kv)
    logits = held["logits"].clone() if "logits" in held else drafter.propose(dcache, new_ctx, bonus, s).clone()
    reset = lambda: rewind(cache, s)  # noqa: E731
    trees = {"dflash": decode.dflash_builder(logits, bonus, bs - 1)}
    run("tree_dflash", lambda: decode.dflash_builder(logits, bonus, bs - 1))
    for b in opts.budgets:
        trees[b] = decode.ddtree_builder(logits, bonus, b)
        run(f"tree_ddtree_{b}", lambda b=b: decode.ddtree_builder(logits, bonus, b))
    chain_ids, chain_pos, _ = decode.tree_inputs(trees["dflash"], s, dev)
    run("verify_dflash", lambda: target.forward(cache, chain_ids, chain_pos), reset, rows=trees["dflash"].size)
    for b in opts.budgets:
        tree = trees[b]
        run(f"tree_inputs_{b}", lambda tree=tree: decode.tree_inputs(tree, s, dev), rows=tree.size)
        ids, pos, mask = decode.tree_inputs(tree, s, dev)
        run(f"verify_ddtree_{b}", lambda ids=ids, pos=pos, mask=mask: target.forward(cache, ids, pos, tree_mask=mask),
            reset, rows=tree.size)
        rewind(cache, s)
        vlogits, vfeats = target.forward(cache, ids, pos, tree_mask=mask)
        vlogits, vfeats = vlogits.clone(), vfeats.clone()
        path, choices = _path_choices(tree)
        hybrid = hasattr(cache, "pending")

        def commit(tree=tree, path=path, choices=choices, vlogits=vlogits, vfeats=vfeats):
            chooser.choose(vlogits)  # the target's choices (device argmax + host copy), as spec_loop
            p, new_bonus = walk(tree, choices)
            rows = torch.tensor(p, dtype=torch.long).to(dev)
            cache.keep(cache.pending[0] if hybrid else s, p, rows)
            accepted_tokens(tree, p, new_bonus)
            return vfeats.index_select(0, rows)

        def setup(n=tree.size, ids=ids, pos=pos, mask=mask):
            if hybrid:  # a real pending tree to commit (its GDN scratch and attention rows)
                rewind(cache, s)
                target.forward(cache, ids, pos, tree_mask=mask)
            else:
                cache.length = s + n  # the verified tree's rows, as after a verify forward

        run(f"commit_ddtree_{b}", commit, setup, rows=len(path))
    rewind(cache, s)
    solo_stages.device_round_stages(engine, opts.budgets, cache, logits, s, bonus, run, rewind)


def parse_tau(text: str | None) -> dict[str, float]:
    """``"ddtree=3.3,dflash=2.1,ddtree-64=3.4"`` -> dict; keys dflash, ddtree or ddtree-B.
    Raises ValueError naming the bad item."""
    out: dict[str, float] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if not (key in ("dflash", "ddtree") or (key.startswith("ddtree-") and key[7:].isdigit())):
            raise ValueError(f"--tau item {item!r}: key must be dflash, ddtree or ddtree-B")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--tau item {item!r}: value must be a number") from None
        if out[key] < 1:
            raise ValueError(f"--tau item {item!r}: tau counts the bonus token, so it is >= 1")
    return out


def run_random_shape(shape: Shape, opts: StageOptions, *, device: str = "auto", dtype: str | None = None,
                     tau: dict[str, float] | None = None, log: Callable[[str], None] = print,
                     engine=None) -> dict:
    """Build (unless ``engine`` is given), measure the copy bandwidth and every stage; returns the
    report document (see bench/random_report.py). The caller writes it."""
    from ddtree_server.bench import random_report as rr

    device, dtype = resolve_device(device, dtype)
    t0 = time.monotonic()
    if engine is None:
        bs = (shape.drafter or {}).get("block_size") or 16
        max_len = opts.context + max((opts.warmup + opts.iters + 2) * bs, max(opts.budgets) + 1 + bs) + 1
        # a hybrid cache keeps what the timed single steps and commits add (see ``rewind``)
        max_len += (opts.warmup + opts.iters) * (2 + 4 * len(opts.budgets))
        engine = build_engine(shape, device=device, dtype=dtype, max_len=max_len, tree_budget=max(opts.budgets))
        if engine.max_model_len < max_len:
            raise ValueError(f"context {opts.context} leaves no room in the shape's "
                             f"{engine.max_model_len} positions for {opts.iters} timed rounds")
    log(f"built {shape.name} on {device} ({dtype}) in {time.monotonic() - t0:.1f} s")
    copy = rr.copy_bandwidth(engine.device)
    log(f"copy bandwidth {copy['gbps_read_write']} GB/s (read + write)")
    stages = measure(engine, opts, log)
    sizes = rr.model_bytes(engine)
    meta = {"shape": shape.name, "source": shape.source, **rr.env_meta(device, dtype), "context": opts.context,
            "iters": opts.iters, "budgets": list(opts.budgets), "draft_ctx_rows": opts.ctx_rows,
            "target": type(engine.target).__name__, "drafter": type(engine.drafter).__name__,
            "drafter_graphs_enabled": getattr(engine.drafter, "enabled", None),
            "seconds": round(time.monotonic() - t0, 1)}
    derived = rr.derive(stages, sizes, copy["gbps_read_write"], tau or {})
    return {"meta": meta, "sizes": sizes, "copy_bandwidth": copy, "stages": stages, "derived": derived,
            "skipped": list(opts.skipped)}
