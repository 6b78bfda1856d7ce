"""HybridPagedSlots: a hybrid (Qwen3.5 / 3.6) target on the paged layout.

Only the full-attention layers keep K/V that grows with the context; they go to pages of 16 rows
like a dense target's (``paged.PagedSlots``, ``kv_geometry``). The Gated-DeltaNet layers keep a
fixed-size recurrent state and conv state per request, which stay per slot: one ``SlotPool`` of
``HybridCache`` objects without K/V of their own (``pool_slots``: the slots and, with CUDA
graphs, the scratch slot of the padding blocks, whose GDN state they write). Each slot's cache
holds a ``PagedSlot`` as its ``kv``: the length, the reset and the compaction of the attention
rows through the slot's page table, so ``HybridCache.begin`` / ``settle`` / ``keep`` (the GDN
commit) work unchanged. At the Qwen3.6-27B shape a slot's GDN state is ~150 MiB and a page of
the 16 attention layers 1 MiB (docs/architecture.md, "Slot memory and admission").
"""

from __future__ import annotations

from ddtree_server.engine.batch.paged import PagedSlot, PagedSlots
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.models.hybrid.model import HybridTarget


class HybridPagedSlots(PagedSlots):
    """``PagedSlots`` of a hybrid ``model``'s attention K/V plus per-slot GDN states (see the module
    docstring); ``scratch``: the round's shared verify scratch (``chunk`` method) or None."""

    def __init__(self, model, num_pages: int, slots: int, max_len: int, device, *, scratch=None,
                 pool_slots: int | None = None, check: bool = False, spare: int = 0):
        super().__init__(model, num_pages, slots, max_len, device, check=check, spare=spare)

        def make():
            cache = model.new_cache(1, scratch=scratch)
            cache.kv = None   # the attention rows are in pages
            return cache

        self.gdn = SlotPool(make, pool_slots or slots)
        for s, cache in enumerate(self.gdn.caches):
            cache.kv, cache.max_len = PagedSlot(self, s, max_len), max_len
        self.caches = self.gdn.caches[:slots]

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot: the GDN recurrent and conv states (and a ``node`` method's scratch)."""
        return self.gdn.slot_bytes

    def pool(self, name: str):
        """The page pools of ``k`` / ``v``, else the GDN slot pool's tensor (``state``, ``conv`` ...)."""
        return super().pool(name) if name in ("k", "v") else self.gdn.pool(name)

    def release(self, slot: int, poison: bool = False) -> int:
        if poison:
            self.gdn.poison(slot)
        return super().release(slot, poison)


def paged_caches(model, pages: int, slots: int, max_len: int, device, *, check: bool, spare: int,
                 scratch=None, pool_slots: int | None = None) -> PagedSlots:
    """The paged layout's caches of ``model`` (the runner's ``caches``): ``PagedSlots`` for a dense
    target, ``HybridPagedSlots`` for a hybrid one."""
    if isinstance(model, HybridTarget):
        return HybridPagedSlots(model, pages, slots, max_len, device, scratch=scratch, pool_slots=pool_slots,
                                check=check, spare=spare)
    return PagedSlots(model, pages, slots, max_len, device, check=check, spare=spare)
