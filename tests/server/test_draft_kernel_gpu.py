"""The batched DFlash drafter on CUDA (skipped without one): its draft blocks attend through the
batched split-K kernel (engine/batch/draft.py, kernels/attention_batch.py ``block`` mode and
sliding windows) and must give each request the proposal of its own ``propose`` (SDPA over its
cache), at lengths past the window and past several key splits, in bf16 and fp32, and with the
batch's CUDA graph (engine/batch/draft_graphs.py) over rounds that carry the K/V over; from the
slot pool and from pages with the sliding-window layers in rings (engine/batch/paged_draft.py:
contexts of up to 5,000 rows appended at once into rings of 2,064)."""

from __future__ import annotations

import pytest
import torch
from ddtree_server.engine.batch.draft import propose_batch
from ddtree_server.engine.batch.draft_graphs import DraftGraphs
from ddtree_server.engine.batch.paged_draft import DraftPages
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.model import DFlashDrafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB, HIDDEN, CAP = 512, 256, 6000


def _drafter(dtype) -> DFlashDrafter:
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
           "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1]}, "num_hidden_layers": 3,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 2048,
           "hidden_size": HIDDEN, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 1e6}
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, HIDDEN).to("cuda", dtype)   # the target's: not the drafter's to move
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to("cuda", dtype)
    return DFlashDrafter(DrafterConfig.from_dict(raw), embed, head).to("cuda", dtype).eval()


def _pages(d, slots: int) -> tuple[DraftPages, torch.Tensor]:
    """DraftPages of ``slots`` slots at CAP rows on shuffled page ids (row ``slots``: no pages)."""
    width = -(-CAP // 16)
    tables = torch.zeros((slots + 1, width), dtype=torch.int32)
    tables[:slots] = (torch.randperm(slots * width, generator=torch.Generator().manual_seed(2)) + 1).view(slots, width)
    pages = DraftPages(d.config, slots * width + 1, slots, CAP, tables.cuda(), d.dtype, "cuda")
    assert pages.ring == 129 and pages.k.shape[1] == 1   # 2 sliding layers in rings of 2048 + 16 rows
    return pages, pages.tables


@pytest.mark.parametrize("layout", ["slot", "paged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_batched_drafter_equals_solo_proposals(dtype, layout):
    d = _drafter(dtype)
    if layout == "slot":
        pool, tables = SlotPool(lambda: d.new_cache(CAP), 6, pooled=True), None   # the last: the graphs' scratch
    else:
        pool, tables = _pages(d, 5)
    graphs = DraftGraphs(d, pool.pool("k"), pool.pool("v"), capture=True, tables=tables)
    assert graphs.kernel
    lens, slots = [5, 700, 2047, 2100, 5000], [3, 0, 4, 1, 2]
    solo = [d.new_cache(CAP) for _ in lens]
    gen = torch.Generator(device="cuda").manual_seed(1)
    ctxs = [torch.randn(n, 2 * HIDDEN, device="cuda", generator=gen, dtype=dtype) for n in lens]
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for rnd in range(4):   # the first round eager (whole contexts), then graph rounds of 1 .. 16 rows
        bonus = [(7 * i + rnd) % VOCAB for i in range(len(lens))]
        ref = torch.stack([d.propose(c, x, b, c.length + x.shape[0]) for c, x, b in zip(solo, ctxs, bonus)])
        starts = [c.length for c in solo]
        caches = [pool[s] for s in slots]
        got = (graphs.propose if rnd else lambda *a: propose_batch(d, pool.pool("k"), pool.pool("v"), *a, tables))(
            caches, slots, ctxs, bonus, starts)
        err = (got.float() - ref.float()).abs().max().item()
        assert err < tol * max(1.0, ref.float().abs().max().item()), (rnd, err)
        ctxs = [torch.randn(1 + (3 * i + rnd) % 16, 2 * HIDDEN, device="cuda", generator=gen, dtype=dtype)
                for i in range(len(lens))]
    assert graphs._static and graphs.enabled, "graph rounds were captured and matched eager"
