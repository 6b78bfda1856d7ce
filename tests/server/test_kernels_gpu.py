"""The split-K attention kernel on a CUDA GPU (skipped without one): a chain verify gives each of
its rows the bits of the one-token step at that position, in bf16 too, so DFlash equals plain
decoding to the bit (kernels/attention.py: fixed row tiles and key pieces). Run by the lead's GPU
scripts; `python tests/server/test_kernels_gpu.py` prints the same checks without pytest."""

from __future__ import annotations

import json
import sys

import pytest
import torch

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128), "qwen3.6-27b-attention": (24, 4, 256)}


def chain_vs_steps(hq: int, hkv: int, d: int, dtype=torch.bfloat16, s0: int = 1000, n: int = 16,
                   rows: int = 2400, config=None) -> dict:
    """Max |chain row - step row| over n tokens for causal and tree-with-a-chain-mask calls."""
    from ddtree_server.kernels.attention import DEFAULT, decode_attention

    config = config or DEFAULT
    g = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(hkv, rows, d, generator=g, device="cuda").to(dtype) for _ in range(2))
    q = torch.randn(n, hq, d, generator=g, device="cuda").to(dtype)
    steps = torch.cat([decode_attention(q[i:i + 1], k, v, torch.tensor(s0 + i, device="cuda"), "causal",
                                        config=config) for i in range(n)])
    out = {}
    for mode in ("causal", "tree"):
        block = torch.ones(n, n, dtype=torch.bool, device="cuda").tril_() if mode == "tree" else None
        whole = decode_attention(q, k, v, torch.tensor(s0, device="cuda"), mode, block, config=config)
        out[mode] = (whole.float() - steps.float()).abs().max().item()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("s0", [1000, 1500, 4000])
def test_chain_rows_equal_one_token_steps_bitwise(shape, s0):
    diffs = chain_vs_steps(*SHAPES[shape], s0=s0, rows=s0 + 600)
    assert diffs == {"causal": 0.0, "tree": 0.0}, diffs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("variant", [0, 2, 4])
def test_paged_batch_rows_equal_the_slot_pool_bitwise(shape, variant, monkeypatch):
    """The batched kernel through page tables (shuffled pages of 16) gives the slot pool's bits in
    bf16 at the real shapes: plain rows, chains and trees of several requests; in every address
    variant of the page pool (DDTREE_PAGED_VARIANT, kernels/attention_paged_kernels.py)."""
    monkeypatch.setenv("DDTREE_PAGED_VARIANT", str(variant))
    from ddtree_server.bench.paged_attention import pools
    from ddtree_server.kernels.attention_batch import batch_attention

    hq, hkv, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(1)
    k, v, kp, vp, table = pools(4, hkv, 2080, d, torch.bfloat16, "cuda", g)
    for n, mode in ((1, "causal"), (16, "causal"), (16, "tree")):
        q = torch.randn(4 * n, hq, d, generator=g, device="cuda").to(torch.bfloat16)
        start = torch.tensor([2000, 17, 1023, 1500], device="cuda") - n + 1
        qo = torch.arange(0, 4 * n + 1, n, device="cuda")
        block = None
        if mode == "tree":   # each node's parent is a random earlier node
            block = torch.eye(n, dtype=torch.bool, device="cuda").repeat(4, 1, 1)
            for i in range(1, n):
                block[:, i] |= block[:, (i * 7 + 3) % i]
        slot = torch.tensor([2, 0, 3, 1], device="cuda")
        want = batch_attention(q, k, v, start, qo, slot, n, mode, block)
        got = batch_attention(q, kp, vp, start, qo, slot, n, mode, block, pages=table[slot].contiguous())
        assert torch.equal(got, want), (shape, n, mode)


if __name__ == "__main__":
    from ddtree_server.kernels.attention import AttnConfig

    report = {f"{name}/s{s0}/{cfg}": chain_vs_steps(*dims, s0=s0, rows=s0 + 600, config=AttnConfig(block_m=bm))
              for name, dims in SHAPES.items() for s0 in (1000, 4000) for bm, cfg in ((64, "m64"), (0, "m-by-rows"))}
    print(json.dumps(report, indent=1))
    sys.exit(0 if all(v == {"causal": 0.0, "tree": 0.0} for k, v in report.items() if k.endswith("m64")) else 1)
