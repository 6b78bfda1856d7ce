"""PagedSlots: the target's K/V of the batch engine in pages (``--kv-layout paged``).

In the slot layout every slot holds K/V rows for ``max_model_len`` tokens from start-up
(``pools.SlotPool``); here the target's K/V is one page pool (``paged_kv.PagedKV``, pages of 16
rows) and a slot holds only the pages its request's rows need (``pages.PagePool``; the page
tables are keyed by slot: a slot holds one request at a time). The engine reserves pages ahead:
a request's prompt at admission, a round's look-ahead before the round (``BatchEngine``), and
returns them when the request finishes, is cancelled or is preempted.

``PagedSlots[i]`` is slot i's cache view for the runner's bookkeeping: its committed ``length``,
``max_len``, ``reset`` and ``keep`` (the compaction of a verified block to its accepted path,
through the slot's page table). The batched forwards read and write through the device page
tables (``table``; ``forward.Layout(pages=...)``). The table width is fixed (the pages of
``max_len`` rows), so the attention kernel's plan, which depends on a request's capacity, is the
same every round. A hybrid target's attention layers take pages the same way; its GDN states
stay per slot (``paged_hybrid.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ddtree_server.engine.batch.paged_kv import PagedKV
from ddtree_server.engine.batch.pages import PAGE_SIZE, PagePool
from ddtree_server.models.hybrid.model import HybridTarget


def kv_geometry(model) -> tuple[int, int, int, torch.dtype]:
    """(layers with K/V, kv heads, head dim, dtype) of a dense target, or of a hybrid's
    full-attention layers (its GDN layers keep no K/V)."""
    dtype = model.embed_tokens.weight.dtype
    if isinstance(model, HybridTarget):
        cfg = model.config
        return len(cfg.attn_layers), cfg.num_key_value_heads, cfg.head_dim, dtype
    attn = model.layers[0].self_attn
    return len(model.layers), attn.n_kv, attn.head_dim, dtype


class PagedSlot:
    """Slot ``slot``'s view of the paged cache: the committed length and the compaction."""

    def __init__(self, owner: "PagedSlots", slot: int, max_len: int):
        self.owner, self.slot, self.max_len, self.length = owner, slot, max_len, 0

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, rows, rows_on_device: Tensor | None = None) -> None:
        """Row ``start + rows[i]`` -> ``start + i`` through the slot's page table (``KVCache.keep``)."""
        self.owner.kv.keep(self.owner.host_table(self.slot), start, rows)
        self.length = start + len(rows)


class PagedSlots:
    """``slots`` slot views over ``num_pages`` pages (the dummy page 0 included) of the target
    ``model``'s K/V (``kv_geometry``), each slot at most ``max_len`` rows. ``check``: verify the page
    bookkeeping after every change (the debug mode of freed-slot poisoning)."""

    def __init__(self, model, num_pages: int, slots: int, max_len: int, device, check: bool = False,
                 spare: int = 0):
        """``spare``: rows the tables address past ``max_len`` (a draft block after the last
        committed row, ``paged_draft.py``; past the reserved pages they map to the dummy page)."""
        need = -(-max_len // PAGE_SIZE)
        if num_pages - 1 < need:
            raise ValueError(f"{num_pages} KV pages cannot hold one request of {max_len} rows: at least "
                             f"{need + 1} are needed ({need} pages of {PAGE_SIZE} rows and the dummy page)")
        self.pages = PagePool(num_pages, check=check)
        self.width = self.pages.pages_for(max_len + spare)
        layers, kv_heads, head_dim, dtype = kv_geometry(model)
        self.kv = PagedKV(layers, num_pages, kv_heads, head_dim, dtype, device)
        self.caches = [PagedSlot(self, s, max_len) for s in range(slots)]
        self._dev: Tensor | None = None   # the device copy of every slot's table (``device_tables``)
        self.shared: list[Tensor] = []    # pools ``[pages, ...]`` on the same page ids (the drafter's)
        self.pooled = True

    def __getitem__(self, slot: int) -> PagedSlot:
        return self.caches[slot]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (K and V of every layer; the drafter's on the same page too)."""
        k = self.kv.k
        return 2 * k[:, 0].numel() * k.element_size() + sum(p[0].numel() * p.element_size() for p in self.shared)

    @property
    def slot_bytes(self) -> int:
        """Nothing is allocated per slot: a request's K/V takes pages (``page_bytes``)."""
        return 0

    def pool(self, name: str) -> Tensor:
        """The page pool ``[layers, pages, kv_heads, page_size, d]`` of ``k`` or ``v``."""
        return {"k": self.kv.k, "v": self.kv.v}[name]

    def locate(self, slots: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page ids, rows within the page) of row ``rows[i]`` of slot ``slots[i]`` (host tables;
        rows past a slot's pages: the dummy page 0)."""
        held = np.unique(slots)
        grid = np.zeros((len(held), self.width), dtype=np.int64)
        for i, s in enumerate(held.tolist()):
            table = self.pages.tables.get(s, [])
            grid[i, : len(table)] = table
        return grid[np.searchsorted(held, slots), rows // PAGE_SIZE], rows % PAGE_SIZE

    def host_table(self, slot: int) -> Tensor:
        return torch.tensor(self.pages.tables.get(slot, []), dtype=torch.long)

    def table(self, slots: list[int], device) -> Tensor:
        """int32 ``[len(slots), width]`` device page tables of the slots (padded with page 0; slot
        ``len(self.caches)``: no pages, the padding blocks of the graphs)."""
        return self.device_tables(device)[torch.tensor(slots, device=device)]

    def device_tables(self, device) -> Tensor:
        """The device copy of every slot's table ``[slots + 1, width]`` (row ``slots``: no pages),
        one tensor updated in place: rows are sent only when they changed (``PagePool.take_changed``)."""
        if self._dev is None:
            self._dev = torch.zeros((len(self.caches) + 1, self.width), dtype=torch.int32, device=device)
            self.pages.changed.update(range(len(self.caches)))
        changed = [s for s in self.pages.take_changed() if isinstance(s, int) and 0 <= s < len(self.caches)]
        if changed:
            self._dev[torch.tensor(changed, device=device)] = self.pages.table(changed, self.width, device)
        return self._dev

    def reserve(self, slot: int, rows: int) -> bool:
        """Pages for ``rows`` rows of ``slot`` (all or nothing)."""
        return self.pages.reserve(slot, rows)

    def release(self, slot: int, poison: bool = False) -> int:
        """Return the slot's pages (``poison``: fill them with NaN first, the debug mode)."""
        held = self.pages.tables.get(slot)
        if poison and held:
            idx = torch.tensor(held, device=self.kv.k.device)
            self.kv.k[:, idx] = float("nan")
            self.kv.v[:, idx] = float("nan")
            for pool in self.shared:
                pool[idx] = float("nan")
        self.caches[slot].length = 0
        return self.pages.release(slot)

