"""Long contexts in the split-K attention kernel (kernels/attention.py) on the CPU, under
TRITON_INTERPRET=1: key lengths around every tile and split boundary, blocks longer than
``LONG_BLOCK`` (prompts), decode steps and trees at 16k, 32k, 40,960 (Qwen3-8B's maximum) and
262,144 (Qwen3.6-27B's) tokens, and the launch limits (CUDA grid axes, 32-bit offsets) of every
benchmark shape up to 262,144 tokens. The GPU runs of the same lengths at real model shapes:
tests/server/test_longctx_gpu.py.

Rows past the live length are NaN in every case: a kernel that read one would return NaN."""

from __future__ import annotations

import pytest

from tests.server.interp_child import module_child

pytest.importorskip("triton")

_CHILD = r"""
import torch
from tests.server.interp_fast import install
install()
from ddtree_server.kernels import attention as A
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)

def err(a, b):
    return ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()

def sample_ref(q, k, v, s, rows):
    # causal reference for a few query tokens of a long block (attention_ref would build [n, s+n])
    out = {}
    hq, hkv = q.shape[1], k.shape[0]
    for i in rows:
        kk = k[:, : s + i + 1].float().repeat_interleave(hq // hkv, 0)
        vv = v[:, : s + i + 1].float().repeat_interleave(hq // hkv, 0)
        p = (torch.einsum("hd,hld->hl", q[i].float(), kk) * q.shape[2] ** -0.5).softmax(-1)
        out[i] = torch.einsum("hl,hld->hd", p, vv)
    return out

def cache(hkv, rows, d, live):
    k, v = (torch.randn(hkv, rows, d, generator=g) for _ in range(2))
    k[:, live:] = float("nan")
    v[:, live:] = float("nan")
    return k, v

def run(which):
    g.manual_seed(0)   # each part's data as in a child of its own
    res = {}
    if which == "boundaries":
        # 4 splits of 16-key tiles: a split's share doubles at 64 * 2**j keys; lengths one either side
        # of each and of a tile edge; n = 1 (a step) everywhere, a 17-node tree where it fits and a
        # 17-token chain at the larger ones
        cfg = A.AttnConfig(block_n=16, ctas_per_sm=64, max_splits=4)
        hq, hkv, d = 2, 1, 16
        for length in (15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257):
            for n, mode in ((1, "causal"), (17, "tree"), (17, "causal")):
                if length < n or (mode == "causal" and n > 1 and length < 255):
                    continue
                s = length - n
                k, v = cache(hkv, 300, d, length)
                q = torch.randn(n, hq, d, generator=g)
                blk = torch.ones(n, n, dtype=torch.bool).tril_() if mode == "tree" else None
                if blk is not None:
                    blk[n - 1, 1: n // 2] = False  # the last node off the chain's path
                got = A.decode_attention(q, k, v, torch.tensor(s), mode, blk, config=cfg)
                res[f"L{length}/n{n}/{mode}"] = err(got, A.attention_ref(q, k, v, s, mode, blk))
    elif which == "long_block":
        # a prompt longer than LONG_BLOCK: default plan (one split: no partials) and a forced one that
        # still splits (partials, merged by the last split: one launch), after a cached prefix
        hq, hkv, d, n, s = 4, 2, 16, A.LONG_BLOCK + 9, 40
        k, v = cache(hkv, s + n + 64, d, s + n)
        q = torch.randn(n, hq, d, generator=g)
        ref = sample_ref(q, k, v, s, (0, 1, 63, 64, 255, n - 2, n - 1))
        for name, cfg in (("default", A.DEFAULT), ("split", A.AttnConfig(ctas_per_sm=64, block_n=16, fused_merge=True))):
            got = A.decode_attention(q, k, v, torch.tensor(s), "causal", config=cfg)
            res[f"{name}/splits{A.plan(n, hq // hkv, hkv, d, k.shape[1], 'cpu', cfg)[2]}"] = max(
                err(got[i], r) for i, r in ref.items())
    elif which == "hybrid":
        # a hybrid target's chains (a prompt longer than LONG_BLOCK, a step, a pending 9-token chain)
        # on the split-K kernel (no [rep*n, s+n] mask) against its SDPA path
        import os
        from ddtree_server.bench.random_shape import build_engine
        from ddtree_server.bench.shapes import get_shape
        torch.manual_seed(0)
        m = build_engine(get_shape("tiny-hybrid"), device="cpu", dtype="fp32", max_len=700).target
        m = getattr(m, "model", m)
        ids = torch.randint(0, m.config.vocab_size, (560,), generator=g)
        from ddtree_server.models.hybrid import layers
        calls = []
        kernel = layers.decode_attention
        layers.decode_attention = lambda q, *a, **kw: calls.append(q.shape[0]) or kernel(q, *a, **kw)
        outs = {}
        for flag in ("0", "1"):
            os.environ["DDTREE_KERNELS"] = flag
            c = m.new_cache(700)
            a, _ = m.forward(c, ids[:550], torch.arange(550), last_only=True)
            b, _ = m.forward(c, ids[550:551], torch.tensor([550]))
            d, _ = m.forward(c, ids[551:560], torch.arange(551, 560))
            outs[flag] = [a, b, d]
        layers.decode_attention = kernel
        res = {name: err(x, y) for name, x, y in zip(("prompt", "step", "chain"), outs["1"], outs["0"])}
        res["kernel_rows"] = sorted(set(calls))
    else:
        # one decode step and one 17-node chain ending at the last position of a long context
        hq, hkv, d = 4, 1, 16
        cfg = A.AttnConfig(block_n=1024)  # fewer, larger key tiles: the interpreter pays per tile
        for length in (16384, 32768, 40960, 262144):
            k, v = cache(hkv, length + 32, d, length)
            for n in (1, 17):
                q = torch.randn(n, hq, d, generator=g)
                got = A.decode_attention(q, k, v, torch.tensor(length - n), "causal", config=cfg)
                want = A.attention_ref(q, k, v, length - n, "causal")
                res[f"L{length}/n{n}/splits{A.plan(n, hq, hkv, d, k.shape[1], 'cpu', cfg)[2]}"] = err(got, want)
    return res


PARTS = {"run": run}
"""


child = module_child(_CHILD, OMP_NUM_THREADS="1")   # one interpreter child for the module's parts


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_lengths_around_every_tile_and_split_boundary(child):
    res = child("run", "boundaries")
    assert len(res) == 12 + 10 + 3  # steps, trees (from 17 keys on), chains (255..257)
    for key, e in res.items():
        assert e < 2e-5, (key, e)  # NaN (a row read past the live length) fails here too


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_a_block_longer_than_long_block_splits_little_and_matches(child):
    res = child("run", "long_block")
    splits = {key.split("/")[0]: int(key.rsplit("splits", 1)[1]) for key in res}
    assert splits["default"] == 1 and splits["split"] > 1, res
    for key, e in res.items():
        assert e < 2e-5, (key, e)


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_steps_and_chains_at_16k_32k_and_each_models_maximum(child):
    res = child("run", "lengths")
    assert len(res) == 8
    for key, e in res.items():
        assert e < 2e-5, (key, e)


@pytest.mark.kernels   # the Triton interpreter: not in `make test-fast`
def test_hybrid_chains_take_the_kernel_and_match_sdpa(child):
    res = child("run", "hybrid")
    assert res.pop("kernel_rows") == [1, 9, 550]  # every chain on the kernel with DDTREE_KERNELS=1 only
    assert set(res) == {"prompt", "step", "chain"}
    for key, e in res.items():
        assert e < 2e-5, (key, e)


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b", "qwen3.6-27b", "smollm2-135m"])
def test_launch_limits_hold_up_to_262144_tokens(name, monkeypatch):
    """Grid axes and 32-bit offsets of every attention launch at an H200's 132 SMs: a whole
    262,144-token prompt, and steps / trees at its end; long blocks keep their fp32 partials small."""
    from ddtree_server.bench.shapes import get_shape
    from ddtree_server.kernels import attention as A

    monkeypatch.setattr(A, "sm_count", lambda device: 132)
    t = get_shape(name).target
    text = t.get("text_config", t)
    hq, hkv = text["num_attention_heads"], text["num_key_value_heads"]
    d = text.get("head_dim") or text["hidden_size"] // hq
    rows = 262144 + 528  # cache rows plus a CUDA-graph bucket's spare rows
    for n in (1, 17, 80, 512, 513, 16384, 40960, 131072, 262144):
        lim = A.launch_limits(n, hq, hkv, d, rows, "cuda")
        A.check_limits(lim)  # raises past a limit
        assert lim["partial_bytes"] < 2 ** 30, (n, lim)
        # the 64-bit offsets would pass 2**31 at these sizes in 32 bits: q / out rows, partials
        assert lim["splits"] * hkv * lim["grid_axis0"] * 64 * d < 2 ** 40
    # decode-size blocks keep the shape's split count (CUDA graphs, bitwise chain == steps)
    assert len({A.plan(n, hq // hkv, hkv, d, rows, "cuda")[2] for n in (1, 17, 65, 80, 512)}) == 1


def test_the_16k_crash_configuration_needs_no_partials(monkeypatch):
    """The illegal memory access of a 16,384-token prompt at the Qwen3-8B shape: 33 splits x 8 KV
    heads x 65,536 padded rows x 128 fp32 partial elements is past 2**31 (docs/architecture.md,
    "Long contexts"). The plan now gives such a block one split (no partials at all)."""
    from ddtree_server.kernels import attention as A

    monkeypatch.setattr(A, "sm_count", lambda device: 132)
    decode_splits = A.plan(1, 4, 8, 128, 16384 + 600, "cuda")[2]
    assert decode_splits == 33 and decode_splits * 8 * 16384 * 4 * 128 > 2 ** 31 - 1
    assert A.plan(16384, 4, 8, 128, 16384 + 600, "cuda")[2] == 1
    with pytest.raises(ValueError, match="grid_axis1"):
        A.check_limits(A.launch_limits(1, 70000, 70000, 16, 64, "cuda"))
