"""GDN tree-verify microbenchmark: per-node states vs tree-masked chunk, at a published shape.

    python -m ddtree_server.bench.hybrid_verify --shape qwen3.6-27b --device cuda --out hv.json

Random weights (``target_from_config``), bf16, CUDA graphs. Prints (and writes) JSON with, for each
GDN tree method (``chunk``, ``node``) and tree size (17 / 33 / 65 nodes = DDTree budgets 16 / 32 /
64, DDTree-like trees from ``build_ddtree``):

* ``per_layer``: one GDN token mixer (projections, conv, delta rule, gated norm) replayed from a
  CUDA graph (``mixer_ms``), the delta rule alone (``rule_ms``), and the mixer eager
  (``mixer_eager_ms``: launch-bound, what an un-graphed server would pay);
* ``verify``: the whole target (``--layers``, default all 64) at a ``--context``-token context
  through ``GraphedHybrid``: ``verify_ms`` = one tree forward, ``round_ms`` = forward + commit of
  a depth-5 path (``commit_ms`` the difference), plus ``plain_step_ms`` (1 token) and
  ``dflash_verify_ms`` (a 16-token chain + commit);
* ``memory``: recurrent + conv state bytes per request and per tree node (docs/hybrid.md).

Medians of ``--iters`` calls after warm-up. The faster ``round_ms`` at 65 nodes decides the
default of ``HybridTarget`` (models/hybrid/model.py). Needs only torch (no server dependencies).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Optional

import typer

SIZES = "17,33,65"


def ddtree_like(n: int, seed: int = 0, depth: int = 15):
    """A DDTree of n nodes from peaked random draft distributions (best-first, Algorithm 1)."""
    import torch

    from ddtree_server.spec.tree import build_ddtree

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, 64, generator=g) * 3.0
    logp, ids = torch.log_softmax(logits, -1).topk(n - 1, dim=-1)
    return build_ddtree(0, logp.numpy(), ids.numpy(), n - 1)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, iters: int, graph: bool) -> float:
    """Median wall time of ``fn`` in ms; ``graph``: replay it from a CUDA graph (CUDA only)."""
    import torch

    for _ in range(3):
        fn()
    _sync()
    if graph and torch.cuda.is_available():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    times = []
    for _ in range(iters):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


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


def layer_bench(cfg, method: str, sizes: list[int], device, dtype, iters: int) -> dict:
    """Time one GDN mixer and the rule alone at the shape of ``cfg``."""
    import torch

    from ddtree_server.models.hybrid import delta
    from ddtree_server.models.hybrid.config import HybridConfig
    from ddtree_server.models.hybrid.tree import tree_meta
    from ddtree_server.models.random_init import target_from_config
    from types import SimpleNamespace

    one = HybridConfig.from_any({**_raw(cfg), "num_hidden_layers": 1, "layer_types": ["linear_attention"],
                                 "vocab_size": 1024})
    model = target_from_config(one, device=device, dtype=dtype, method=method)
    mixer, cache = model.layers[0].linear_attn, model.new_cache(64)
    out = {}
    for n in sizes:
        tree = ddtree_like(n)
        mask = torch.from_numpy(tree.ancestors()).to(device)
        meta = tree_meta(mask, n, one.linear_conv_kernel_dim, device)
        ctx = SimpleNamespace(meta=meta, mode=method)
        h = torch.randn(n, one.hidden_size, device=device, dtype=dtype)
        hv, dk, dv = one.linear_num_value_heads, one.linear_key_head_dim, one.linear_value_head_dim
        q, k = (torch.nn.functional.normalize(torch.randn(n, hv, dk, device=device), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(n, hv, dv, device=device), -torch.rand(n, hv, device=device), torch.rand(n, hv, device=device)
        s0 = torch.randn(hv, dk, dv, device=device) * 0.1
        if method == "chunk":
            def rule():
                return delta.tree_chunk(q, k, v, g, beta, s0, mask)
        else:
            def rule():
                return delta.per_node(q, k, v, g, beta, s0, meta.parent, cache.nodes[0])

        def mix():
            return mixer(h, cache, 0, ctx)
        out[str(n)] = {"mixer_ms": _median_ms(mix, iters, True), "rule_ms": _median_ms(rule, iters, True),
                       "mixer_eager_ms": _median_ms(mix, max(5, iters // 5), False)}
    del model, cache
    _empty_cache()
    return out


def verify_bench(cfg, method: str, sizes: list[int], context: int, device, dtype, iters: int) -> dict:
    """Whole-target verify / round / plain step / DFlash verify through GraphedHybrid."""
    import torch

    from ddtree_server.engine.decode import tree_inputs
    from ddtree_server.models.hybrid.graphs import GraphedHybrid
    from ddtree_server.models.random_init import target_from_config
    from ddtree_server.spec.tree import chain_tree

    model = target_from_config(cfg, device=device, dtype=dtype, method=method)
    target = GraphedHybrid(model, capture=torch.device(device).type == "cuda")
    cache = target.new_cache(context + iters * 40 + 512)
    gen = torch.Generator().manual_seed(0)
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
            verify = _median_ms(lambda: call(tree, []), iters, False)
            rnd = _median_ms(lambda: call(tree, path), iters, False)
            out[str(n)] = {"verify_ms": verify, "round_ms": rnd, "commit_ms": round(rnd - verify, 4),
                           "path_len": len(path)}
        one = chain_tree(1, [])
        out["plain_step_ms"] = _median_ms(lambda: call(one, [0]), iters, False)
        chain = chain_tree(1, list(range(2, 17)))
        out["dflash_verify_ms"] = _median_ms(lambda: call(chain, list(range(5))), iters, False)
        out["context_at_start"], out["context_at_end"] = s0, cache.length
    if torch.cuda.is_available():
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
    del target, model, cache
    _empty_cache()
    return out


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _raw(cfg) -> dict:
    from dataclasses import asdict

    raw = asdict(cfg)
    raw.pop("extra", None)
    raw.update(model_type="qwen3_5_text", layer_types=list(cfg.layer_types), rope_parameters=cfg.rope_parameters)
    return raw


def measure(shape: str | dict, sizes: list[int], context: int, dtype: str, device: str, iters: int,
            layers: int | None = None, methods=("chunk", "node"), whole: bool = True) -> dict:
    """The benchmark as a dict (see the module docstring). shape: a published name or a text
    config dict. On CPU nothing is graphed (a smoke run of the same code)."""
    import torch

    from ddtree_server.models.hybrid.config import HybridConfig
    from ddtree_server.models.hybrid.shapes import published
    from ddtree_server.models.load import resolve_dtype

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
    for m in methods:
        report["per_layer"][m] = layer_bench(cfg, m, sizes, device, dt, iters)
    if whole:
        for m in methods:
            report["verify"][m] = verify_bench(cfg, m, sizes, context, device, dt, iters)
        big = str(max(sizes))
        report["faster_round_at_%s" % big] = min(methods, key=lambda m: report["verify"][m][big]["round_ms"])
    return report


def main(shape: str = typer.Option("qwen3.6-27b", help="Published shape (models/hybrid/shapes.py)."),
         sizes: str = typer.Option(SIZES, help="Tree sizes in nodes (budget + 1)."),
         context: int = typer.Option(1024, min=1, help="Context tokens before the verify."),
         dtype: str = typer.Option("bf16", help="bf16 | fp16 | fp32."),
         device: str = typer.Option("cuda", help="A CUDA device."),
         iters: int = typer.Option(50, min=5, help="Timed calls per figure (median)."),
         layers: Optional[int] = typer.Option(None, min=1, help="Only the first N layers (quick runs)."),
         methods: str = typer.Option("chunk,node", help="GDN tree methods to time."),
         whole: bool = typer.Option(True, help="Also time the whole target."),
         out: Optional[Path] = typer.Option(None, help="Write the JSON here too.")) -> None:
    """Time GDN tree verification (per-node states vs tree-masked chunk) at a published shape."""
    import torch

    from ddtree_server.commands.options import int_list

    if not torch.cuda.is_available() or not device.startswith("cuda"):
        raise typer.BadParameter("needs a CUDA device (--device cuda[:N])")
    report = measure(shape, int_list(sizes), context, dtype, device, iters, layers,
                     tuple(m for m in methods.split(",") if m), whole)
    text = json.dumps(report, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    from ddtree_server.commands.options import run_single

    run_single(main)
