"""DraftPages: the DFlash drafter's context K/V in pages on the target's page ids (the paged layout).

In the slot layout every slot holds the drafter's context K/V for ``max_model_len`` positions
(``pools.SlotPool`` of ``DraftCache``); here they are a page pool ``[pages, layers, kv_heads, 16,
d]`` with as many pages as the target's (``paged.PagedSlots``), and page p holds the drafter's
K/V of the same 16 positions of the same request as the target's page p. One page table per slot
serves both: a request's pages are reserved, freed and preempted once, for both models, and the
batched drafter (``draft.py``, ``tables=``) reads and writes through the persistent device copy of
the tables (``PagedSlots.device_tables``: updated in place, so the drafter's CUDA graphs take it
as a static input). A slot keeps only its drafter length (``DraftLength``).

The draft block of a request writes positions ``[s, s + block_size)``; the round's look-ahead
reserves ``[s, s + max(grant, block_size))`` for a drafting request (``admission.py``; a ddtree
budget below the block, a round shrunk to a chain), and a request granted a plain round does not
draft. Rows past the table's reserved pages (none in the engine) would land on the dummy page 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.batch.pools import SlotPool


class DraftLength:
    """A slot's drafter context length (the ``DraftCache`` bookkeeping without its tensors)."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a draft cache of length {self.length} to {length}")
        self.length = length


class DraftPages:
    """The drafter's K / V pools on ``num_pages`` pages and ``slots`` slot lengths; ``tables``:
    the device page tables ``[slots + 1, width]`` of the target's pages (row ``slots``: no pages)."""

    pooled = True
    slot_bytes = 0   # nothing per slot: the pages are counted with the target's (``page_bytes``)

    def __init__(self, config, num_pages: int, slots: int, max_len: int, tables: Tensor, dtype, device):
        shape = (num_pages, config.num_hidden_layers, config.num_key_value_heads, PAGE_SIZE, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.caches = [DraftLength(max_len) for _ in range(slots)]
        self.tables = tables

    def __getitem__(self, slot: int) -> DraftLength:
        return self.caches[slot]

    def pool(self, name: str) -> Tensor:
        return {"k": self.k, "v": self.v}[name]

    def poison(self, slot: int) -> None:
        """Nothing: the pages of a freed slot are the target's to poison (``PagedSlots.release``)."""

    @staticmethod
    def page_bytes(config, dtype) -> int:
        """Bytes of one page of the drafter's K and V (every layer)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * PAGE_SIZE * config.head_dim * elem


def draft_caches(drafter, raw, slots: int, pool_slots: int, max_len: int, pooled: bool, paged=None, device=None):
    """The drafter's context K/V of the batch engine: ``DraftPages`` on the pages of ``paged``
    (``PagedSlots``; its freed pages are poisoned with the target's in the debug mode), else a
    ``SlotPool`` of ``pool_slots`` caches of ``max_len`` rows (``pooled``: a DFlash drafter ``raw``)."""
    if paged is not None and pooled:
        pages = DraftPages(raw.config, paged.pages.num_pages, slots, max_len, paged.device_tables(device),
                           raw.dtype, device)
        paged.shared += [pages.k, pages.v]
        return pages
    return SlotPool(lambda: drafter.new_cache(max_len), pool_slots, pooled=pooled)
