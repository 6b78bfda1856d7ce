"""DFlashDrafter forward semantics (docs/ddtree.md §1.5, §1.6): cached propose == from-scratch
forward."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from tests.server.drafter_fixtures import randomize, target_parts, zlab_config

BS, MASK = 8, 250
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}


@pytest.fixture(scope="module", params=["full", "sliding"])
def drafter(request) -> DFlashDrafter:
    """The plain z-lab layout, and the Qwen3.6 drafters' one (sliding layers, then a full one)."""
    raw = zlab_config(block_size=BS, **(SLIDING if request.param == "sliding" else {}))
    emb, head = target_parts(seed=1)
    return randomize(DFlashDrafter(DrafterConfig.from_dict(raw), emb, head), seed=2).eval()


def _ctx(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 3 * 64, generator=torch.Generator().manual_seed(seed))


def _reference(drafter, ctx: torch.Tensor, bonus: int) -> torch.Tensor:
    block = torch.tensor([[bonus] + [MASK] * (BS - 1)])
    with torch.no_grad():
        return drafter(ctx[None], block)[0]


def test_propose_equals_full_forward_over_rounds(drafter):
    ctx = _ctx(40)
    cache = drafter.new_cache(64)
    start = 0
    for step, (n, bonus) in enumerate([(13, 7), (1, 9), (5, 100), (9, 3), (12, 44)]):
        start += n
        got = drafter.propose(cache, ctx[start - n:start], bonus, start)
        want = _reference(drafter, ctx[:start], bonus)
        assert got.shape == (BS - 1, 256)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"round {step}")
        assert cache.length == start


def test_bonus_embedding_in_row_zero(drafter):
    ctx = _ctx(20)
    a = drafter.propose(drafter.new_cache(40), ctx, 5, 20)
    b = drafter.propose(drafter.new_cache(40), ctx, 6, 20)
    all_mask = _reference(drafter, ctx, MASK)
    assert not torch.allclose(a, b)
    assert not torch.allclose(a, all_mask)
    torch.testing.assert_close(drafter.propose(drafter.new_cache(40), ctx, MASK, 20), all_mask, rtol=1e-5, atol=1e-5)


def test_cache_cropped_to_start_pos(drafter):
    ctx = _ctx(30)
    cache = drafter.new_cache(48)
    drafter.propose(cache, ctx[:10], 1, 10)
    before_k = cache.k[:, :, :10].clone()
    assert cache.length == 10
    drafter.propose(cache, ctx[10:30], 2, 30)
    assert cache.length == 30
    assert torch.equal(cache.k[:, :, :10], before_k)  # earlier context untouched by the block
    with pytest.raises(ValueError, match="does not fill"):
        drafter.propose(cache, ctx[:3], 2, 40)
    with pytest.raises(ValueError, match="cannot hold a block"):
        drafter.propose(cache, ctx[:12], 2, 42)
    cache.crop(25)
    torch.testing.assert_close(drafter.propose(cache, ctx[25:30], 4, 30), _reference(drafter, ctx, 4),
                               rtol=1e-5, atol=1e-5)


def test_block_is_bidirectional(drafter):
    ctx = _ctx(12)[None]
    block = torch.tensor([[3] + [MASK] * (BS - 1)])
    changed = block.clone()
    changed[0, -1] = 17
    with torch.no_grad():
        a, b = drafter(ctx, block), drafter(ctx, changed)
    assert not torch.allclose(a[0, 0], b[0, 0])  # row 1 sees the block's last slot


def test_context_is_visible_to_every_row(drafter):
    ctx = _ctx(12)
    other = ctx.clone()
    other[0] += 1.0
    a, b = _reference(drafter, ctx, 3), _reference(drafter, other, 3)
    assert all(not torch.allclose(a[j], b[j]) for j in range(BS - 1))


def test_forward_train_matches_per_block_forward(drafter):
    g = torch.Generator().manual_seed(5)
    t = 30
    ids = torch.randint(0, 200, (2, t), generator=g)
    ctx = torch.randn(2, t, 3 * 64, generator=g)
    anchors = torch.tensor([[4, 10, 11, 25], [1, 20, 3, 3]])
    valid = torch.tensor([[True, True, True, True], [True, True, True, False]])
    with torch.no_grad():
        hidden = drafter.forward_train(ctx, ids, anchors, valid)
        logits = drafter.lm_head(hidden[:, :, 1:])
    assert hidden.shape == (2, 4, BS, 64)
    for b in range(2):
        for i in range(4):
            if not valid[b, i]:
                assert torch.isfinite(logits[b, i]).all()
                continue
            a = int(anchors[b, i])
            want = _reference(drafter, ctx[b, :a], int(ids[b, a]))
            torch.testing.assert_close(logits[b, i], want, rtol=1e-4, atol=1e-4, msg=f"seq {b} anchor {a}")


def test_shared_modules_are_not_parameters(drafter):
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert drafter.embed_tokens.weight.shape == (256, 64)


def test_sliding_layers_are_causal_and_windowed():
    """A sliding layer hides later block slots and context older than its window (z-lab rule)."""
    emb, head = target_parts(seed=1)
    raw = zlab_config(block_size=BS, num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=4)
    d = randomize(DFlashDrafter(DrafterConfig.from_dict(raw), emb, head), seed=2).eval()
    ctx = _ctx(12)
    block = torch.tensor([[3] + [MASK] * (BS - 1)])
    later, old = block.clone(), ctx.clone()
    later[0, -1] = 17
    old[:12 - 3 - 2 * 3] += 1.0  # older than any row's 2-layer receptive window: never seen
    with torch.no_grad():
        a, b = d(ctx[None], block), d(ctx[None], later)
        c = d(old[None], block)
    assert torch.allclose(a[0, :-1], b[0, :-1]) and not torch.allclose(a[0, -1], b[0, -1])
    torch.testing.assert_close(a, c)
    assert not torch.allclose(_reference(d, ctx, 3)[0], _reference(d, _ctx(12, seed=9), 3)[0])
