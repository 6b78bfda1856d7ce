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

Sliding-window layers (the Qwen3.6-27B drafter's 4 layers of window 2048) see only the last
``window`` positions, so they keep a ring per slot instead (``ring_pages``: the window and one
draft block, in pages of 16 rows): a page pool ``[(slots + 1) * ring, ...]`` of its own, addressed
through fixed ring tables (slot r's position p: ring page ``r * ring + (p // 16) % ring``), so
every reader and writer of ``draft.py`` and the attention kernels takes a ring as one more page
pool with its table (``LayerPool``). A page of the target's then holds the drafter's full layers
only (27B shape: 1.31 -> 1.06 MiB a page) and each slot keeps its rings (``slot_bytes``).
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


def ring_pages(config, max_len: int) -> int:
    """Pages of one slot's ring for the sliding-window layers: the window and a draft block (the
    block's rows then never overwrite a row that a query still sees); 0 without sliding layers or
    when a ring would not be shorter than a slot of ``max_len`` rows."""
    windows = [config.attention_kind(i)[1] for i in range(config.num_hidden_layers)]
    if all(w is None for w in windows):
        return 0
    ring = -(-(max(w for w in windows if w is not None) + config.block_size) // PAGE_SIZE)
    return ring if ring * PAGE_SIZE < max_len else 0


def _ringed(config, max_len: int) -> list[bool]:
    """Per drafter layer: kept in a ring (a sliding-window layer, when rings pay)."""
    ring = ring_pages(config, max_len)
    return [bool(ring) and config.attention_kind(i)[1] is not None for i in range(config.num_hidden_layers)]


class LayerPool:
    """K or V of every drafter layer on two page pools: the target's page ids (full layers, read
    through the tables the callers pass) and the slots' rings (sliding-window layers, through
    ``ring_tables``)."""

    def __init__(self, pages: Tensor, rings: Tensor, ringed: list[bool], ring_tables: Tensor):
        self.pages, self.rings, self.ring_tables = pages, rings, ring_tables
        self.ring_rows = rings.shape[0] // ring_tables.shape[0] * PAGE_SIZE   # rows of one slot's ring
        self.place = [(r, ringed[:i].count(r)) for i, r in enumerate(ringed)]   # (in a ring, index there)
        self.device, self.dtype = pages.device, pages.dtype

    def element_size(self) -> int:
        return self.pages.element_size()

    def layer(self, i: int, tables: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Layer i's pool ``[pages, kv_heads, 16, d]`` and the tables that address it."""
        ringed, j = self.place[i]
        return (self.rings[:, j], self.ring_tables) if ringed else (self.pages[:, j], tables)


class DraftPages:
    """The drafter's K / V pools on ``num_pages`` pages and ``slots`` slot lengths; ``tables``:
    the device page tables ``[slots + 1, width]`` of the target's pages (row ``slots``: no pages).
    Sliding-window layers in rings of ``ring`` pages per slot (and one for row ``slots``)."""

    pooled = True

    def __init__(self, config, num_pages: int, slots: int, max_len: int, tables: Tensor, dtype, device):
        ringed = _ringed(config, max_len)
        geometry = (config.num_key_value_heads, PAGE_SIZE, config.head_dim)
        self.k = torch.zeros((num_pages, ringed.count(False), *geometry), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.caches = [DraftLength(max_len) for _ in range(slots)]
        self.tables = tables
        self.ring = ring_pages(config, max_len)
        self._pools = {"k": self.k, "v": self.v}
        if self.ring:
            shape = ((slots + 1) * self.ring, ringed.count(True), *geometry)
            self.rk = torch.zeros(shape, dtype=dtype, device=device)
            self.rv = torch.zeros_like(self.rk)
            pos = torch.arange(tables.shape[1], device=device)
            ring_tables = (torch.arange(slots + 1, device=device)[:, None] * self.ring + pos % self.ring)
            self.ring_tables = ring_tables.to(torch.int32)
            self._pools = {"k": LayerPool(self.k, self.rk, ringed, self.ring_tables),
                           "v": LayerPool(self.v, self.rv, ringed, self.ring_tables)}

    def __getitem__(self, slot: int) -> DraftLength:
        return self.caches[slot]

    def pool(self, name: str) -> Tensor | LayerPool:
        """The page pool of ``k`` or ``v`` (``[pages, layers, kv_heads, 16, d]``), or with rings
        the ``LayerPool`` of both."""
        return self._pools[name]

    @property
    def slot_bytes(self) -> int:
        """Bytes a slot keeps outside the pages: its rings (the pages are counted with the
        target's: ``page_bytes``)."""
        return 0 if not self.ring else 2 * self.rk[: self.ring].numel() * self.rk.element_size()

    def poison(self, slot: int) -> None:
        """Fill the freed slot's rings with NaN (the debug mode; its pages are the target's to poison)."""
        if self.ring:
            self.rk[slot * self.ring:(slot + 1) * self.ring] = float("nan")
            self.rv[slot * self.ring:(slot + 1) * self.ring] = float("nan")

    @staticmethod
    def page_bytes(config, dtype, max_len: int) -> int:
        """Bytes of one page of the drafter's K and V (every layer not in a ring)."""
        return _kv_bytes(config, dtype, _ringed(config, max_len).count(False), PAGE_SIZE)

    @staticmethod
    def ring_bytes(config, dtype, max_len: int) -> int:
        """Bytes of one slot's rings (0 without)."""
        return _kv_bytes(config, dtype, _ringed(config, max_len).count(True), ring_pages(config, max_len) * PAGE_SIZE)


def _kv_bytes(config, dtype, layers: int, rows: int) -> int:
    """Bytes of K and V of ``rows`` rows in ``layers`` drafter layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * config.num_key_value_heads * rows * config.head_dim * elem


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
