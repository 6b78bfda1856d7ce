"""GDN tree-verify benchmark at a published shape: per-node states vs tree-masked chunk, and the
fused Triton kernels (``DDTREE_KERNELS``) on vs off.

    python -m ddtree_server.bench.hybrid_verify --shape qwen3.6-27b --device cuda --out hv.json

Random weights (``target_from_config``), bf16, CUDA graphs. Prints (and writes) JSON with, for each
GDN tree method (``--methods``, default ``chunk``) and tree size (17 / 33 / 65 nodes = DDTree budgets
16 / 32 / 64, DDTree-like trees from ``build_ddtree``), on the torch path (kernels off):

* ``per_layer``: one GDN token mixer (projections, conv, delta rule, gated norm) replayed from a
  CUDA graph (``mixer_ms``), the delta rule alone (``rule_ms``), and the mixer eager
  (``mixer_eager_ms``: launch-bound, what an un-graphed server would pay);
* ``verify``: the whole target (``--layers``, default all 64) at a ``--context``-token context
  through ``GraphedHybrid``: ``verify_ms`` = one tree forward, ``round_ms`` = forward + commit of
  a depth-5 path (``commit_ms`` the difference), plus ``plain_step_ms`` (1 token) and
  ``dflash_verify_ms`` (a 16-token chain + commit);
* ``memory``: recurrent + conv state bytes per request and per tree node (docs/hybrid.md);

and, with ``--kernels on,off`` (the default), a ``kernels`` section for the chunk method with the
same figures per setting (``per_layer`` adds the 1-row decode-step mixer ``"1"`` and the GPU
kernels launched by one eager mixer call, ``gpu_ops``, counted with torch.profiler), ``failed``
(the kernels' self-check message if they turned themselves off: then "on" measured the torch
path) and ``summary``: verify / plain step at the largest tree, per setting.

Medians of ``--iters`` calls after warm-up. Needs only torch (no server dependencies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ddtree_server.bench.timing import empty_cache, median_ms
from ddtree_server.bench.trees import ddtree_like

SIZES = "17,33,65"
SETTINGS = ("on", "off")


def state_memory(cfg, sizes=(17, 33, 65), tree_rows: int = 80) -> dict:
    """Bytes of GDN state per request and per tree node for both methods (model dtype 2 bytes)."""
    gdn, hv, dk, dv = len(cfg.gdn_layers), cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = gdn * hv * dk * dv * 4
    conv = gdn * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * 2
    conv_row = gdn * cfg.conv_dim * 2
    node = {"chunk": gdn * (hv * dk + hv * dv + hv) * 4 + conv_row, "node": gdn * hv * dk * dv * 4 + conv_row}
    extra = {"chunk": 0, "node": state}  # node: slot 0 holds a copy of the start state
    return {"committed_state_bytes": state, "committed_conv_bytes": conv, "per_request_bytes": state + conv,
            "per_node_bytes": node,
            "per_tree_bytes": {m: {str(n): n * node[m] + extra[m] for n in sizes} for m in node},
            "static_per_request_bytes": {m: state + conv + tree_rows * node[m] + extra[m] for m in node}}


def verify_bench(model, sizes: list[int], context: int, device, iters: int) -> dict:
    """Whole-target verify / round / plain step / DFlash verify through a new GraphedHybrid."""
    import torch

    from ddtree_server.engine.decode import tree_inputs
    from ddtree_server.models.hybrid.graphs import GraphedHybrid
    from ddtree_server.speculative.tree import chain_tree

    cfg = model.config
    target = GraphedHybrid(model, capture=torch.device(device).type == "cuda")
    cache = target.new_cache(context + iters * 40 + 512)
    gen = torch.Generator().manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        target.forward(cache, torch.randint(0, min(1000, cfg.vocab_size), (context,), generator=gen).to(device),
                       torch.arange(context, device=device))
        out, s0 = {}, cache.length

        def call(tree, path):
            s = cache.length
            ids, pos, mask = tree_inputs(tree, s, device)
            target.forward(cache, ids, pos, tree_mask=mask)
            cache.keep(s, path)
        for n in sizes:
            tree = ddtree_like(n)
            leaf = max(range(n), key=lambda i: (tree.depths[i] <= 5, tree.depths[i], -i))
            path, j = [], leaf
            while j >= 0:
                path.append(j)
                j = tree.parents[j]
            path = path[::-1]
            verify = median_ms(lambda: call(tree, []), iters, False)
            rnd = median_ms(lambda: call(tree, path), iters, False)
            out[str(n)] = {"verify_ms": verify, "round_ms": rnd, "commit_ms": round(rnd - verify, 4),
                           "path_len": len(path)}
        one = chain_tree(1, [])
        out["plain_step_ms"] = median_ms(lambda: call(one, [0]), iters, False)
        chain = chain_tree(1, list(range(2, 17)))
        out["dflash_verify_ms"] = median_ms(lambda: call(chain, list(range(5))), iters, False)
        out["context_at_start"], out["context_at_end"] = s0, cache.length
    if torch.cuda.is_available():
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    target = cache = None                      # drop the references before empty_cache()
    empty_cache()
    return out


def measure(shape: str | dict, sizes: list[int], context: int, dtype: str, device: str, iters: int,
            layers: int | None = None, methods=("chunk", "node"), whole: bool = True, settings=()) -> dict:
    """The benchmark as a dict (see the module docstring). shape: a published name or a text
    config dict; settings: kernel settings to compare (``on`` / ``off``), for the chunk method.
    On CPU nothing is graphed (a smoke run of the same code)."""
    import torch

    from ddtree_server.bench.gdn_layer import kernels, layer_bench
    from ddtree_server.models.hybrid import gdn_fast
    from ddtree_server.models.hybrid.config import HybridConfig
    from ddtree_server.models.hybrid.shapes import published
    from ddtree_server.models.common import resolve_dtype
    from ddtree_server.models.random_init import target_from_config

    raw = published(shape)[0] if isinstance(shape, str) else dict(shape)
    if layers:
        raw.update(num_hidden_layers=layers, layer_types=raw["layer_types"][:layers])
    cfg = HybridConfig.from_any(raw)
    dt = resolve_dtype(dtype)
    report = {"shape": shape if isinstance(shape, str) else "custom", "layers": cfg.num_hidden_layers, "gdn_layers": len(cfg.gdn_layers),
              "hidden": cfg.hidden_size, "dtype": dtype, "context": context, "iters": iters,
              "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
              "torch": torch.__version__,
              "memory": state_memory(cfg, tuple(sizes)), "per_layer": {}, "verify": {}}
    kern = {"per_layer": {}, "verify": {}} if settings else None
    off = "off" if settings else None  # the torch-path figures run with the kernels off
    for m in methods:
        report["per_layer"][m] = layer_bench(cfg, m, sizes, device, dt, iters, off)
        if kern is not None and m == "chunk":
            for st in settings:
                kern["per_layer"][st] = report["per_layer"][m] if st == "off" else layer_bench(cfg, m, sizes, device, dt, iters, st)
    if whole:
        for m in methods:
            model = target_from_config(cfg, device=device, dtype=dt, method=m)
            with kernels(off):
                report["verify"][m] = verify_bench(model, sizes, context, device, iters)
            if kern is not None and m == "chunk":
                for st in settings:
                    with kernels(st):
                        kern["verify"][st] = report["verify"][m] if st == "off" else verify_bench(model, sizes, context, device, iters)
            del model
            empty_cache()
        big = str(max(sizes))
        report["faster_round_at_%s" % big] = min(methods, key=lambda m: report["verify"][m][big]["round_ms"])
    if kern is not None:
        kern["failed"] = list(gdn_fast._failed)
        kern["self_checked"] = sorted(str(k[:2]) for k in gdn_fast._checked)
        kern["summary"] = {st: _summary(v, str(max(sizes))) for st, v in kern["verify"].items()}
        report["kernels"] = kern
    return report


def _summary(v: dict, big: str) -> dict:
    plain = v["plain_step_ms"]
    return {"plain_step_ms": plain, f"verify_{big}_ms": v[big]["verify_ms"], f"round_{big}_ms": v[big]["round_ms"],
            "verify_over_plain": round(v[big]["verify_ms"] / plain, 3),
            "round_over_plain": round(v[big]["round_ms"] / plain, 3),
            "dflash_verify_over_plain": round(v["dflash_verify_ms"] / plain, 3)}


def main(shape: str = typer.Option("qwen3.6-27b", help="Published shape (models/hybrid/shapes.py)."),
         sizes: str = typer.Option(SIZES, help="Tree sizes in nodes (budget + 1)."),
         context: int = typer.Option(1024, min=1, help="Context tokens before the verify."),
         dtype: str = typer.Option("bf16", help="bf16 | fp16 | fp32."),
         device: str = typer.Option("cuda", help="A CUDA device."),
         iters: int = typer.Option(50, min=5, help="Timed calls per figure (median)."),
         layers: Optional[int] = typer.Option(None, min=1, help="Only the first N layers (quick runs)."),
         methods: str = typer.Option("chunk", help="GDN tree methods to time (chunk, node)."),
         kernels_: str = typer.Option("on,off", "--kernels", help="Fused-kernel settings to compare (on, off; empty: none)."),
         whole: bool = typer.Option(True, help="Also time the whole target."),
         out: Optional[Path] = typer.Option(None, help="Write the JSON here too.")) -> None:
    """Time GDN tree verification (per-node states vs tree-masked chunk, kernels on vs off)."""
    import torch

    from ddtree_server.commands.options import int_list

    if not torch.cuda.is_available() or not device.startswith("cuda"):
        raise typer.BadParameter("needs a CUDA device (--device cuda[:N])")
    settings = tuple(x for x in kernels_.split(",") if x)
    if any(x not in SETTINGS for x in settings):
        raise typer.BadParameter(f"--kernels takes a comma list of {SETTINGS}, got {kernels_!r}")
    report = measure(shape, int_list(sizes), context, dtype, device, iters, layers,
                     tuple(m for m in methods.split(",") if m), whole, settings)
    text = json.dumps(report, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
