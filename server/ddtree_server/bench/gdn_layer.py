"""One GDN token mixer timed alone at a published shape (part of ``bench.hybrid_verify``).

``layer_bench`` builds a one-layer hybrid with random weights and times, per tree size, the mixer
replayed from a CUDA graph, the delta rule alone and the mixer eager; with a kernel setting
(``DDTREE_KERNELS`` on / off, ``kernels``) also the 1-row decode-step mixer and the GPU kernels
one eager mixer call launches (``gpu_ops``, torch.profiler).
"""

from __future__ import annotations

import contextlib
import os

from ddtree_server.bench.timing import empty_cache, median_ms, sync
from ddtree_server.bench.trees import ddtree_like


@contextlib.contextmanager
def kernels(setting: str | None):
    """``DDTREE_KERNELS`` for the block: ``on`` -> 1, ``off`` -> 0, None -> unchanged."""
    from ddtree_server.kernels.runtime import ENV

    old = os.environ.get(ENV)
    if setting is not None:
        os.environ[ENV] = "1" if setting == "on" else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def gpu_ops(fn) -> int | None:
    """GPU kernels (and copies) one eager call of ``fn`` launches, by torch.profiler; None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a profiler without CUPTI: no count
        return None


def layer_bench(cfg, method: str, sizes: list[int], device, dtype, iters: int, setting: str | None = None) -> dict:
    """Time one GDN mixer and the rule alone at the shape of ``cfg``. With a kernels ``setting``
    also the 1-row decode-step mixer (``"1"``) and ``gpu_ops`` per eager mixer call."""
    import torch

    from ddtree_server.kernels import runtime
    from ddtree_server.models.hybrid.config import HybridConfig
    from ddtree_server.models.hybrid.tree import tree_meta
    from ddtree_server.models.random_init import target_from_config
    from types import SimpleNamespace

    one = HybridConfig.from_any({**_raw(cfg), "num_hidden_layers": 1, "layer_types": ["linear_attention"],
                                 "vocab_size": 1024})
    model = target_from_config(one, device=device, dtype=dtype, method=method)
    mixer, cache = model.layers[0].linear_attn, model.new_cache(64)
    hk, hv, dk, dv = one.linear_num_key_heads, one.linear_num_value_heads, one.linear_key_head_dim, one.linear_value_head_dim
    out = {}
    with kernels(setting), torch.inference_mode():
        fast = setting == "on" and runtime.enabled(device)
        for n in ([1] if setting else []) + sizes:
            if n == 1:
                mask, meta = None, tree_meta(None, 1, one.linear_conv_kernel_dim, device)
            else:
                mask = torch.from_numpy(ddtree_like(n).ancestors()).to(device)
                meta = tree_meta(mask, n, one.linear_conv_kernel_dim, device)
            ctx = SimpleNamespace(meta=meta, mode="commit" if n == 1 else method)
            h = torch.randn(n, one.hidden_size, device=device, dtype=dtype)
            q, k = (torch.nn.functional.normalize(torch.randn(n, hk, dk, device=device), dim=-1) for _ in range(2))
            qr, kr = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
            v, g, beta = torch.randn(n, hv, dv, device=device), -torch.rand(n, hv, device=device), torch.rand(n, hv, device=device)
            s0 = torch.randn(hv, dk, dv, device=device) * 0.1
            rule = _rule(fast, method, n, (q, k, qr, kr, v, g, beta, s0), mask, meta, cache)

            def mix():
                return mixer(h, cache, 0, ctx)
            row = {"mixer_ms": median_ms(mix, iters, True), "rule_ms": median_ms(rule, iters, True),
                   "mixer_eager_ms": median_ms(mix, max(5, iters // 5), False)}
            if setting:
                row["gpu_ops"] = gpu_ops(mix)
            out[str(n)] = row
    model = cache = None                       # drop the references before empty_cache()
    empty_cache()
    return out


def _rule(fast: bool, method: str, n: int, inputs, mask, meta, cache):
    """The delta rule alone on fixed inputs: the kernels' or the torch form of the mixer's path."""
    from ddtree_server.models.hybrid import delta

    q, k, qr, kr, v, g, beta, s0 = inputs
    if fast:
        from ddtree_server.kernels.gdn_state import step_rule
        from ddtree_server.kernels.gdn_tree import tree_rule

        if n == 1:
            state = s0.clone()
            return lambda: step_rule(q, k, v, g, beta, state)
        if method == "chunk":
            G = mask.float() @ g
            return lambda: tree_rule(q, k, v, G, beta, s0, mask, cache.kk[0], cache.uu[0])
    if n == 1:
        return lambda: delta.step(qr[0], kr[0], v[0], g[0], beta[0], s0)
    if method == "chunk":
        return lambda: delta.tree_chunk(qr, kr, v, g, beta, s0, mask)
    return lambda: delta.per_node(qr, kr, v, g, beta, s0, meta.parent, cache.nodes[0])


def _raw(cfg) -> dict:
    from dataclasses import asdict

    raw = asdict(cfg)
    raw.pop("extra", None)
    raw.update(model_type="qwen3_5_text", layer_types=list(cfg.layer_types), rope_parameters=cfg.rope_parameters)
    return raw
