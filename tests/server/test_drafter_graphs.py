"""GraphedDrafter: the static (graph-ready) propose path equals the eager DFlashDrafter.propose."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.graphs import GraphedDrafter
from tests.server.drafter_fixtures import randomize, target_parts, zlab_config

BS = 8
ROUNDS = [(13, 7), (1, 9), (3, 100), (5, 3), (8, 44), (20, 5), (2, 250), (7, 1)]  # (new context rows, bonus)


SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}


def _drafter(device="cpu", dtype=torch.float32, **extra) -> DFlashDrafter:
    emb, head = target_parts(seed=1)
    d = randomize(DFlashDrafter(DrafterConfig.from_dict(zlab_config(block_size=BS, **extra)), emb, head), seed=2)
    emb.to(device=device, dtype=dtype)
    head.to(device=device, dtype=dtype)
    return d.to(device=device, dtype=dtype).eval()


def _compare(graphed: GraphedDrafter, eager: DFlashDrafter, device, atol: float, max_len: int = 96) -> None:
    ctx = torch.randn(sum(n for n, _ in ROUNDS), 3 * 64, generator=torch.Generator().manual_seed(3)).to(device)
    c_g, c_e = graphed.new_cache(max_len), eager.new_cache(max_len)
    start = 0
    for step, (n, bonus) in enumerate(ROUNDS):
        start += n
        got = graphed.propose(c_g, ctx[start - n:start].to(eager.dtype), bonus, start).clone()
        want = eager.propose(c_e, ctx[start - n:start].to(eager.dtype), bonus, start)
        assert c_g.length == c_e.length == start
        torch.testing.assert_close(got.float(), want.float(), rtol=atol, atol=atol, msg=f"round {step}")
        torch.testing.assert_close(c_g.k[:, :, :start].float(), c_e.k[:, :, :start].float(), rtol=atol, atol=atol)


@pytest.mark.parametrize("layout", ["full", "sliding"])
@pytest.mark.parametrize("max_len", [96, 300])  # key window = whole cache / 256 of 300 rows (masked tail)
def test_static_path_equals_eager_cpu(max_len, layout):
    d = _drafter(**(SLIDING if layout == "sliding" else {}))
    graphed = GraphedDrafter(d, capture=False)
    _compare(graphed, d, "cpu", 1e-5, max_len)
    assert graphed.enabled and graphed._checked
    assert {n for n, _ in graphed._static} == {1, 2, 4, 8, 16}  # n=20 ran eagerly


def test_self_check_disables_on_mismatch():
    d = _drafter()
    graphed = GraphedDrafter(d, capture=False)
    graphed._run = lambda st, cache: torch.zeros(BS - 1, 256)  # a broken static path
    ctx = torch.randn(5, 3 * 64)
    out = graphed.propose(graphed.new_cache(64), ctx, 3, 5)
    assert not graphed.enabled
    torch.testing.assert_close(out, d.propose(d.new_cache(64), ctx, 3, 5), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager():
    d = _drafter("cuda", torch.bfloat16)
    graphed = GraphedDrafter(d, capture=True)
    _compare(graphed, d, "cuda", 0.1)
    assert graphed.enabled and any(st.graph is not None for st in graphed._static.values())
