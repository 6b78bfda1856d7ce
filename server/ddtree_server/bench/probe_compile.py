"""GPU probe part: ``torch.compile`` against our eager layer, both replayed from our own CUDA graph.

Run as its own process by ``bench/probe.py`` (a compile can take minutes and cannot be interrupted
in-process): ``python -m ddtree_server.bench.probe_compile OUT.jsonl DEADLINE_EPOCH_S``. Every
result is appended to OUT.jsonl at once, so a run killed at its deadline keeps what it measured.

Steps, most informative first, each skipped when less than ``MIN_STEP_S`` is left:
* one decoder layer (plain step: 1 new token after 1,024 cached, key window 2,048) of the 8B and
  the SmolLM2 shape: our eager layer vs ``torch.compile(mode=...)`` for mode "default" and
  "max-autotune-no-cudagraphs", each captured 10 times back to back in one CUDA graph (us/layer);
* the whole forward (``TargetModel.run`` compiled, replayed by ``GraphedTarget``) of a plain step.
A failure is recorded as the step's ``error``, never fatal.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

MIN_STEP_S = 15.0
CONTEXT = 1024


def _emit(path: str, rec: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def _layer_setup(shape_name: str):
    """A 1-layer target of the shape, its cache and the inputs of one plain-step layer call."""
    from ddtree_server.bench.shapes import get_shape
    from ddtree_server.models.random_init import target_from_config

    shape = get_shape(shape_name)
    cfg = dict(shape.target, num_hidden_layers=1)
    model = target_from_config(cfg, device="cuda", dtype="bf16")
    cache = model.new_cache(2 * CONTEXT + 64)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    x = torch.randn(1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([CONTEXT], device="cuda")
    cos, sin = model._rope(pos, x.dtype)
    kv_len = 2 * CONTEXT
    rep = model.config.num_attention_heads // model.config.num_key_value_heads
    visible = torch.arange(kv_len, device="cuda") <= CONTEXT
    mask = torch.zeros((1, 1, rep, kv_len), device="cuda", dtype=x.dtype).masked_fill_(~visible, float("-inf"))
    args = (cos, sin, cache, 0, mask, pos, kv_len)
    return model, model.layers[0], x, args


def _layer_us(fn, x, args, chain: int = 10) -> float:
    from ddtree_server.bench.timing import graph_time_us
    from ddtree_server.models.layers import attention_backends

    def call():
        y = x
        for _ in range(chain):
            y = fn(y, *args)
        return y

    with attention_backends(x.device):
        return graph_time_us([call]) / chain


def layer_step(path: str, shape_name: str, mode: str | None) -> None:
    """Eager (mode None) or compiled layer: us per layer call inside a CUDA graph, compile seconds."""
    rec = {"part": "compile_layer", "shape": shape_name, "mode": mode or "eager"}
    try:
        model, layer, x, args = _layer_setup(shape_name)
        fn = layer
        if mode is not None:
            from torch import _dynamo

            _dynamo.reset()
            fn = torch.compile(layer, mode=None if mode == "default" else mode, dynamic=False)
            t0 = time.monotonic()
            with torch.no_grad():
                from ddtree_server.models.layers import attention_backends

                with attention_backends(x.device):
                    fn(x, *args)
            torch.cuda.synchronize()
            rec["compile_s"] = round(time.monotonic() - t0, 1)
        with torch.no_grad():
            rec["us_per_layer"] = round(_layer_us(fn, x, args), 2)
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec["trace"] = traceback.format_exc()[-1500:]
    _emit(path, rec)


def forward_step(path: str, shape_name: str, mode: str | None, iters: int = 30) -> None:
    """Whole-forward plain step through GraphedTarget, with ``TargetModel.run`` compiled or not."""
    from ddtree_server.bench.timing import time_calls
    from ddtree_server.bench.shapes import get_shape
    from ddtree_server.models.dense.graphs import GraphedTarget
    from ddtree_server.models.random_init import target_from_config

    rec = {"part": "compile_forward", "shape": shape_name, "mode": mode or "eager"}
    try:
        model = target_from_config(get_shape(shape_name).target, device="cuda", dtype="bf16")
        if mode is not None:
            from torch import _dynamo

            _dynamo.reset()
            model.run = torch.compile(model.run, mode=None if mode == "default" else mode, dynamic=False)
        target = GraphedTarget(model)
        cache = target.new_cache(2 * CONTEXT + 64)
        dev = torch.device("cuda")
        with torch.inference_mode():
            cache.length = CONTEXT  # the cached rows' values do not change the time
            ids, pos = torch.tensor([1], device=dev), torch.tensor([CONTEXT], device=dev)
            t0 = time.monotonic()
            target.forward(cache, ids, pos)  # compile (if any) + capture
            torch.cuda.synchronize()
            rec["first_call_s"] = round(time.monotonic() - t0, 1)
            r = time_calls(lambda: target.forward(cache, ids, pos), iters, 3, dev, lambda: cache.truncate(CONTEXT))
        rec["step_ms"] = round(r["ms"], 4)
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec["trace"] = traceback.format_exc()[-1500:]
    _emit(path, rec)


STEPS = (
    (layer_step, "qwen3-8b", None), (layer_step, "qwen3-8b", "default"),
    (layer_step, "smollm2-135m", None), (layer_step, "smollm2-135m", "default"),
    (forward_step, "smollm2-135m", None), (forward_step, "smollm2-135m", "default"),
    (layer_step, "qwen3-8b", "max-autotune-no-cudagraphs"),
    (layer_step, "smollm2-135m", "max-autotune-no-cudagraphs"),
    (forward_step, "qwen3-8b", None), (forward_step, "qwen3-8b", "default"),
)


def main(path: str, deadline_epoch: float) -> None:
    """Run STEPS in order until the deadline (seconds since the epoch)."""
    for fn, shape, mode in STEPS:
        left = deadline_epoch - time.time()
        if left < MIN_STEP_S:
            _emit(path, {"part": fn.__name__, "shape": shape, "mode": mode or "eager",
                         "skipped": f"time budget ({left:.0f} s left)"})
            continue
        fn(path, shape, mode)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
