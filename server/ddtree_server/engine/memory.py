"""Memory sizing of the engine: request slots and KV pages from the free GPU memory.

Slot layout: every slot holds the target's KV (and GDN state) and the drafter's context K/V at
max_model_len; without ``--max-running`` on CUDA the engine takes as many slots as
``kv_memory_fraction`` of the free memory after loading holds (``slots_for``; at most
``CUDA_MAX_RUNNING``). Paged layout: the target's K/V (a hybrid's attention layers') and the
DFlash drafter's context K/V in pages of 16 tokens on the same page ids (``paged_draft.py``; a
page costs both), as many as ``kv_memory_fraction`` of the free memory holds after what stays
per slot (a hybrid's GDN states, ``paged_hybrid.py``; the drafter's sliding-window rings) and the
round scratch (``default_pages``).
The default layout (``choose_layout``) is paged where the slots would not hold the batch at
max_model_len (on CUDA), else slot, whose lone request runs the per-request CUDA graphs (and on a
dense target the one-graph DDTree round: faster at batch 1). Off CUDA the defaults are fixed (``CPU_MAX_RUNNING``;
pages for every slot at max_model_len). The sizes are measured on one cache built on the meta
device here (``pools.measured``: shapes only, nothing allocated).
"""

from __future__ import annotations

import torch

from ddtree_server.engine.batch.hybrid_rounds import round_rows
from ddtree_server.engine.batch.paged import kv_geometry
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.batch.paged_draft import DraftPages
from ddtree_server.engine.batch.pools import cache_bytes, measured, slot_cache_bytes
from ddtree_server.models.dense.target import TargetModel
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.hybrid.model import HybridTarget

CPU_MAX_RUNNING = 4    # default requests in one batch on the CPU
CUDA_MAX_RUNNING = 64  # upper bound of the CUDA default (sized from free memory below it)
KV_MEMORY_FRACTION = 0.5  # share of the free GPU memory the slots' caches may take (CUDA default)


def _model(engine):
    return getattr(engine.target, "model", engine.target)


def slots_for(free_bytes: int, slot_bytes: int, fraction: float, cap: int = CUDA_MAX_RUNNING, once: int = 0) -> int:
    """Slots that ``fraction`` of ``free_bytes`` holds at ``slot_bytes`` each after ``once`` bytes
    (buffers of the engine, not of a slot: a hybrid's round scratch): at least 1, at most ``cap``."""
    return max(1, min(cap, (int(fraction * free_bytes) - once) // max(slot_bytes, 1)))


def drafter_slot_bytes(engine) -> int:
    """Bytes of one slot's drafter context K/V at max_model_len (0 without a drafter)."""
    if engine.drafter is None:
        return 0
    return measured(lambda: engine.drafter.new_cache(_draft_rows(engine)), cache_bytes)


def _dflash(engine):
    """The engine's DFlash drafter module (its K/V can be paged), else None."""
    raw = getattr(engine.drafter, "drafter", engine.drafter)
    return raw if isinstance(raw, DFlashDrafter) else None


def _scratch_bytes(engine) -> int:
    """Bytes of a hybrid's round verify scratch at its most rows (``chunk`` method), else 0."""
    model = _model(engine)
    if isinstance(model, HybridTarget) and model.method == "chunk":
        return model.new_scratch(round_rows(engine.round_rows, CUDA_MAX_RUNNING), "meta").nbytes
    return 0


def state_bytes(engine) -> int:
    """Bytes a hybrid's slot keeps on the paged layout: its GDN recurrent and conv states (a
    one-row cache less its attention rows; the ``chunk`` method's verify scratch is the round's:
    ``slot_cache_bytes`` leaves it out), else 0."""
    model = _model(engine)
    if not isinstance(model, HybridTarget):
        return 0
    return measured(lambda: model.new_cache(1), lambda cache: slot_cache_bytes(cache) - cache_bytes(cache.kv))


def _draft_rows(engine) -> int:
    """Rows of a slot of the drafter's context K/V (the runner's ``draft_caches``)."""
    return engine.max_model_len + 1 + (engine.block_size or 0)


def paged_slot_bytes(engine) -> int:
    """Bytes a slot keeps outside the pages: a hybrid's GDN states, a DFlash drafter's rings of
    its sliding-window layers (its other K/V is in the pages), or the context K/V of another drafter."""
    dflash = _dflash(engine)
    if dflash is None:
        return state_bytes(engine) + drafter_slot_bytes(engine)
    return state_bytes(engine) + DraftPages.ring_bytes(dflash.config, dflash.dtype, _draft_rows(engine))


def slot_bytes(engine, paged: bool = False) -> tuple[int, int]:
    """Bytes of one slot's caches (the target's KV / GDN state and the drafter's context K/V at
    max_model_len), and the bytes allocated once whatever the slots (a hybrid's round scratch, at
    its most rows). ``paged``: what stays per slot (a hybrid's GDN states; nothing for a DFlash
    drafter, whose K/V is in the pages too, else the drafter's), counted twice: the slots take at
    most half the budget, the pages the rest."""
    once = _scratch_bytes(engine)
    if paged:
        return 2 * paged_slot_bytes(engine), once
    per_slot = measured(lambda: engine.target.new_cache(engine.max_model_len + 1)) + drafter_slot_bytes(engine)
    return per_slot, once


def default_running(engine, asked: int | None, fraction: float, paged: bool = False) -> int:
    """Requests decoded together: ``asked``, else the defaults above (1 without a batched forward)."""
    if not isinstance(_model(engine), (TargetModel, HybridTarget)):
        return 1  # no batched forward (transformers runner)
    if asked is not None:
        return int(asked)
    if engine.device.type != "cuda":
        return CPU_MAX_RUNNING
    per_slot, once = slot_bytes(engine, paged)
    if per_slot == 0:
        return CUDA_MAX_RUNNING
    free, _ = torch.cuda.mem_get_info(engine.device)
    return slots_for(free, per_slot, fraction, once=once)


def choose_layout(engine, asked: str, running: int | None, fraction: float) -> tuple[str, int | None]:
    """The KV layout of ``asked`` (``auto``, ``slot``, ``paged``): ``auto`` is ``paged`` for a
    target with a batched forward on CUDA when ``fraction`` of the free memory holds fewer slots
    at max_model_len than ``running`` requests (default ``CUDA_MAX_RUNNING``), else ``slot`` (the CPU).
    Second: the requests decoded together when that measure chose slots (all of them fit: what
    ``default_running`` would measure again), else None."""
    if asked != "auto":
        return asked, None
    if engine.device.type != "cuda" or not isinstance(_model(engine), (TargetModel, HybridTarget)):
        return "slot", None
    want = int(running) if running is not None else CUDA_MAX_RUNNING
    per_slot, once = slot_bytes(engine)
    free, _ = torch.cuda.mem_get_info(engine.device)
    fits = slots_for(free, per_slot, fraction, cap=want, once=once) >= want
    return ("slot", want) if fits else ("paged", None)


def page_bytes(model, drafter=None, draft_rows: int = 0) -> int:
    """Bytes of one page of the target's K/V (K and V, every layer with K/V: ``kv_geometry``) and
    of a DFlash ``drafter``'s on the same page ids (its layers not in rings at slots of
    ``draft_rows`` rows), without building them."""
    layers, kv_heads, head_dim, dtype = kv_geometry(model)
    own = 2 * layers * kv_heads * PAGE_SIZE * head_dim * torch.empty((), dtype=dtype).element_size()
    return own + (DraftPages.page_bytes(drafter.config, drafter.dtype, draft_rows) if drafter is not None else 0)


def default_pages(engine, slots: int, fraction: float, asked: int | None) -> int:
    """Pages of the paged layout: ``asked`` when given (not 0); on the CPU as many as ``slots``
    requests at max_model_len take (the slot layout's capacity); on CUDA what ``fraction`` of the
    free memory holds (a page: the target's and a DFlash drafter's K/V) after the ``slots``' own
    bytes (a hybrid's GDN states, another drafter's slots) and the round scratch; at least one
    request at max_model_len and the dummy page."""
    least = -(-(engine.max_model_len + 1) // PAGE_SIZE) + 1
    if asked:
        return int(asked)
    if engine.device.type != "cuda":
        return slots * (least - 1) + 1
    free, _ = torch.cuda.mem_get_info(engine.device)
    dflash = _dflash(engine)   # the drafter's rings have one more slot: the graphs' scratch (paged_draft.py)
    rings = DraftPages.ring_bytes(dflash.config, dflash.dtype, _draft_rows(engine)) if dflash is not None else 0
    budget = int(fraction * free) - slots * paged_slot_bytes(engine) - rings - _scratch_bytes(engine)
    return max(least, budget // page_bytes(_model(engine), dflash, _draft_rows(engine)))
