"""Admission and look-ahead by KV pages (the paged layout; bookkeeping over ``pages.PagePool``).

* **Admission** (``take``): a waiting request gets a slot only when the free pages hold its
  prompt (or a preempted request's recompute) and still leave one page per running request for
  its next round: a request admitted into the last pages would only be preempted at once.
* **Look-ahead** (``plan``): before a decode round every decoding request asks for the rows its
  tree would write (``budget + 1``; a chain: the block size; plain: 1); ``pages.plan_round``
  grants them while the free pages last, else shrinks the newest requests' trees to chains and
  then to plain rounds, and only then preempts the newest requests (prefilling ones too: they
  hold their prompt's pages). The granted rows are reserved here and bound the request's tree
  (``Request.grant``; ``StepRunner.room``); a drafting request's reservation covers the
  drafter's block too (its K/V rows after the committed length, ``paged_draft.py``), and a
  request granted a plain round does not draft.

vLLM and nano-vllm do the same with blocks: admit while the free blocks hold the prompt,
preempt the newest running request by recompute when a decode step's blocks run out.
"""

from __future__ import annotations

from ddtree_server.engine.batch.pages import Ask, PageError, plan_round


class PageAdmission:
    """``slots``: the runner's ``PagedSlots``; ``block_size``: the drafter's (None: no drafter)."""

    def __init__(self, slots, block_size: int | None):
        self.slots, self.block_size = slots, block_size
        self.shrunk = 0   # rounds of a request whose rows were cut below its tree's

    @property
    def pages(self):
        return self.slots.pages

    def take(self, req, slot: int, running: int) -> bool:
        """Reserve ``req``'s prefill rows in ``slot`` if they leave a page for each of the
        ``running`` requests; whether it was taken."""
        rows = len(req.prefill_ids)
        if self.pages.free_pages - self.pages.growth(slot, rows) < running:
            return False
        return self.slots.reserve(slot, rows)

    def _ask(self, req, order: int, speculate: bool, room: int) -> Ask:
        if req.prefilling:   # its prompt's pages are held already; it writes nothing this round
            return Ask(req.slot, len(req.prefill_ids), 0, 0, order, plain=0)
        drafts = speculate and req.mode != "ar"
        nodes = min(req.budget, room) if drafts else 0
        chain = min(nodes, self.block_size - 1) if self.block_size else 0
        return Ask(req.slot, req.s, nodes + 1, chain + 1, order, draft=(self.block_size or 0) if drafts else 0)

    def plan(self, running: list, decoding: list, speculate: bool, room, preempt) -> None:
        """Grant and reserve every decoding request's rows of the next round (``room(req)``: the
        draft nodes its cache can take) after ``preempt(req)`` (which frees its pages) of the
        requests that must go, newest first."""
        for req in decoding:
            req.grant = None
        asks = [self._ask(r, i, speculate, room(r)) for i, r in enumerate(running)]
        grant, preempted = plan_round(self.pages, asks)
        ask = {a.rid: a for a in asks}
        self.shrunk += sum(1 for a in asks if a.rid in grant and grant[a.rid] < a.tree)
        by_slot = {r.slot: r for r in running}
        for slot in preempted:
            preempt(by_slot[slot])
        for req in decoding:
            if req.slot is None:   # preempted
                continue
            req.grant = grant[req.slot]
            if not self.slots.reserve(req.slot, req.s + ask[req.slot].rows(req.grant)):
                raise PageError(f"slot {req.slot}: {req.grant} granted rows do not fit the free pages")
