"""Scheduler: admission and slots of the batch engine (pure bookkeeping, no tensors).

FCFS: waiting requests take the lowest free slot while fewer than ``max_running`` run. A running
request first prefills its prompt (``chunks``: at most a token budget per step over all prefilling
requests, oldest first), then decodes (``decoding``: one round per step).
"""

from __future__ import annotations

import heapq
from collections import deque

from ddtree_server.engine.batch.request import Request


class Scheduler:
    """Waiting queue, running set and the free-slot heap (lowest slot first, so batch 1 always
    runs in slot 0)."""

    def __init__(self, max_running: int):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free = list(range(max_running))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def admit(self, take=None) -> list[Request]:
        """Move waiting requests into free slots (FCFS); returns the admitted ones. ``take(req,
        slot)``: whether the request may have the slot (the paged layout reserves its prompt's
        pages there); the first refusal stops admission (no request overtakes an older one)."""
        out = []
        while self.waiting and self._free:
            if take is not None and not take(self.waiting[0], self._free[0]):
                break
            req = self.waiting.popleft()
            req.slot = heapq.heappop(self._free)
            self.running.append(req)
            out.append(req)
        return out

    def release(self, req: Request) -> int | None:
        """Retire a finished request: remove it from the queue or the running set, free its slot."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        slot, req.slot = req.slot, None
        if slot is not None:
            heapq.heappush(self._free, slot)
        return slot

    def requeue(self, req: Request) -> int | None:
        """A preempted request: out of the running set, its slot freed, first in the queue."""
        slot = self.release(req)
        self.waiting.appendleft(req)
        return slot

    def chunks(self, budget: int | None) -> list[tuple[Request, int]]:
        """This step's prompt chunks: ``(request, tokens)`` for the prefilling requests in admission
        order, at most ``budget`` tokens in all (None: every prompt whole). The oldest request's
        prompt is finished first, so its first token comes as early as the budget allows."""
        out, left = [], budget
        for req in self.running:
            if not req.prefilling:
                continue
            n = len(req.prefill_ids) - req.prefilled
            if left is not None:
                if left <= 0:
                    break
                n = min(n, left)
                left -= n
            out.append((req, n))
        return out

    def decoding(self) -> list[Request]:
        """Running requests whose prompt is prefilled (the next decode round's batch)."""
        return [r for r in self.running if not r.prefilling]

    @property
    def prefilling(self) -> int:
        """Running requests whose prompt is not yet wholly in their slot's cache."""
        return sum(1 for r in self.running if r.prefilling)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.rid == rid:
                return req
        return None
