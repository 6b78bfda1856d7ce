"""Phase-2 probe part: one layer's attention, the kernel (kernels/attention.py) against the SDPA call
the graphed engine made before it, at real head layouts.

For each shape's (layers, heads, KV heads, head_dim), cached length s and N new rows (a causal
block, as a DFlash verify; the tree mask costs the same):
* ``sdpa``: the query rows of one KV head stacked (GQA without repeating K/V), an additive mask over
  the power-of-two key window of ``GraphedTarget`` (>= s + N, at least 256), memory-efficient /
  flash SDPA (cuDNN excluded, as the engine does), the output relaid out to ``[N, heads*head_dim]``;
* ``kernel``: ``decode_attention`` over the live rows ``[0, s + N)`` with s from a device scalar.
Each is timed as a CUDA graph of one call per layer, every layer on its own cache (so the 50-60 MB
L2 cannot serve the keys across calls); GB/s counts the live K/V rows read once.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

LENGTHS = (256, 1024, 4096)
ROWS = (1, 16, 80)
SWEEP_POINTS = {"qwen3-8b": ((1024, 1), (1024, 80)), "smollm2-135m": ((1024, 1),)}


def _sweep():
    from ddtree_server.kernels.attention import AttnConfig

    return AttnConfig(fused_merge=True), AttnConfig(block_n=32), AttnConfig(ctas_per_sm=4)


class _Setup:
    """Caches of every layer, and the calls of one (s, N) point."""

    def __init__(self, shape_name: str, dev: torch.device, dtype=torch.bfloat16):
        from ddtree_server.bench.shapes import get_shape

        cfg = get_shape(shape_name).target
        self.name, self.layers = shape_name, cfg["num_hidden_layers"]
        self.hq, self.hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.hq
        self.rows = 2 * max(LENGTHS) + 2 * max(ROWS)
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (self.layers, self.hkv, self.rows, self.d)
        self.k = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        self.v = torch.randn(shape, generator=g, device=dev, dtype=dtype)
        self.dev, self.dtype = dev, dtype

    def point(self, s: int, n: int):
        """(sdpa(layer), kernel(layer, config), bytes per call)."""
        from ddtree_server.kernels.attention import DEFAULT, decode_attention
        from ddtree_server.models.dense.graphs import MIN_KV

        rep, hq, hkv, d = self.hq // self.hkv, self.hq, self.hkv, self.d
        q = torch.randn(n, hq, d, device=self.dev, dtype=self.dtype)
        block = torch.ones(n, n, dtype=torch.bool, device=self.dev).tril_()
        start = torch.tensor(s, device=self.dev)
        window = min(max(MIN_KV, 1 << (s + n - 1).bit_length()), self.rows)
        col = torch.arange(window, device=self.dev) - s
        vis = (col < 0)[None, :] | ((col[None, :] <= torch.arange(n, device=self.dev)[:, None]) & (col < n)[None, :])
        mask = torch.zeros((n, window), dtype=self.dtype, device=self.dev).masked_fill_(~vis, float("-inf"))
        mask = mask.repeat(rep, 1)[None, None]
        qs = q.transpose(0, 1).reshape(1, hkv, rep * n, d)

        def sdpa(layer: int):
            o = F.scaled_dot_product_attention(qs, self.k[layer, :, :window][None], self.v[layer, :, :window][None],
                                               attn_mask=mask)
            return o.reshape(hq, n, d).transpose(0, 1).reshape(n, -1)

        def kernel(layer: int, config=DEFAULT):
            return decode_attention(q, self.k[layer], self.v[layer], start, "tree", block, config=config)

        return sdpa, kernel, 2 * hkv * (s + n) * d * self.k.element_size()


def _time(calls: list[Callable[[], object]]) -> float:
    from ddtree_server.bench.timing import graph_time_us
    from ddtree_server.models.layers import attention_backends

    with attention_backends(torch.device("cuda")):
        return graph_time_us(calls)


def attention_part(deadline: float, shapes=("qwen3-8b", "smollm2-135m"), log=print) -> list[dict]:
    """Rows {shape, s, n, splits, sdpa_us, kernel_us, speedup, kernel_gbps, max_abs_diff}; then one
    row per swept config at the shape's SWEEP_POINTS ({config, kernel_us}). Stops at ``deadline``
    (monotonic): the default-config rows of every shape come first."""
    from ddtree_server.kernels.attention import plan

    dev = torch.device("cuda")
    out: list[dict] = []
    setups = {}
    for name in shapes:
        st = setups[name] = _Setup(name, dev)
        for s in LENGTHS:
            for n in ROWS:
                row = {"shape": name, "s": s, "n": n}
                if time.monotonic() > deadline:
                    out.append({**row, "skipped": "time budget"})
                    continue
                sdpa, kernel, nbytes = st.point(s, n)
                ref, got = sdpa(0).float(), kernel(0).reshape(n, -1).float()
                row["max_abs_diff"] = round((got - ref).abs().max().item(), 5)
                row["splits"] = plan(n, st.hq // st.hkv, st.hkv, st.d, st.rows, dev)[2]
                row["sdpa_us"] = round(_time([lambda i=i: sdpa(i) for i in range(st.layers)]), 2)
                row["kernel_us"] = round(_time([lambda i=i: kernel(i) for i in range(st.layers)]), 2)
                row["speedup"] = round(row["sdpa_us"] / row["kernel_us"], 2)
                row["kernel_gbps"] = round(nbytes / row["kernel_us"] / 1e3, 1)
                log(f"attention {name} s={s} N={n}: SDPA {row['sdpa_us']} us, kernel {row['kernel_us']} us "
                    f"({row['kernel_gbps']} GB/s, {row['splits']} splits), max diff {row['max_abs_diff']}")
                out.append(row)
    for name, st in setups.items():
        for s, n in SWEEP_POINTS.get(name, ()):
            _, kernel, nbytes = st.point(s, n)
            for cfg in _sweep():
                row = {"shape": name, "s": s, "n": n, "config": cfg.name}
                if time.monotonic() > deadline:
                    out.append({**row, "skipped": "time budget"})
                    continue
                try:
                    want = kernel(0).float()  # default config
                    row["max_abs_diff_vs_default"] = round((kernel(0, cfg).float() - want).abs().max().item(), 5)
                    row["kernel_us"] = round(_time([lambda i=i, c=cfg: kernel(i, c) for i in range(st.layers)]), 2)
                    row["kernel_gbps"] = round(nbytes / row["kernel_us"] / 1e3, 1)
                except Exception as exc:  # noqa: BLE001 - a config that fails is recorded, not fatal
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"attention sweep {name} s={s} N={n} {cfg.name}: {row.get('kernel_us', row.get('error'))}")
                out.append(row)
    del setups
    torch.cuda.empty_cache()
    return out
