"""BatchEngine: one ``step()`` advances every running request by one round.

A step is either a prefill step (requests admitted since the last step: each whole prompt in one
forward on its slot, giving its first token) or a decode round over every running request (plain,
DFlash and DDTree requests in the same target forward: ``runner.py``). The host admits, streams
and stops: stop rules per request (``StopChecker``), a cancelled request ends at the next step
boundary, a finished one frees its slot for the next waiting request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ddtree_server.engine.batch.request import GenerationEvent, Request
from ddtree_server.engine.batch.runner import StepRunner
from ddtree_server.engine.batch.scheduler import Scheduler


@dataclass
class StepInfo:
    """What the last step did: ``kind`` prefill / decode, requests in it, tokens it produced,
    seconds; for a decode round also its draft nodes and tree kinds."""

    kind: str = "idle"
    batch: int = 0
    tokens: int = 0
    seconds: float = 0.0
    nodes: int = 0                      # decode: draft nodes verified over all requests (N)
    kinds: dict | None = None           # decode: requests per tree kind (plain / chain / tree)


class BatchEngine:
    """Scheduler + step runner; see the module docstring. Not thread-safe (one worker thread)."""

    def __init__(self, target, drafter, *, max_running: int, max_len: int, device, poison: bool = False,
                 policy=None):
        self.scheduler = Scheduler(max_running)
        self.runner = StepRunner(target, drafter, slots=max_running, max_len=max_len, device=device,
                                 poison=poison, policy=policy)
        self.block_size = self.runner.block_size
        self.last = StepInfo()
        self.steps = 0

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    @property
    def busy(self) -> bool:
        return self.scheduler.busy

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    def add(self, req: Request) -> None:
        """Queue a validated request (``Engine.make_request``); it is admitted at a later step."""
        self.scheduler.add(req)

    def abort(self, req: Request) -> None:
        """Drop a request without a final event (its consumer went away)."""
        if not req.finished:
            req.finished = True
            self._release(req)

    def _release(self, req: Request) -> None:
        slot = self.scheduler.release(req)
        if slot is not None:
            self.runner.free(slot)
        req.ctx = None

    def _emit(self, req: Request, out: list, ids: list[int], text: str, finish: str | None) -> None:
        logprobs = req.take_logprobs(len(ids), finish is not None)
        stats = None
        if finish is not None:
            req.finished = True
            stats = req.stats(self.block_size, time.perf_counter())
            self._release(req)
        ev = GenerationEvent(ids, text, finish, stats, logprobs)
        req.events.append(ev)
        out.append((req, ev))

    def _feed(self, req: Request, tokens: list[int] | None, out: list) -> None:
        if tokens is None:  # the request's cache is full
            self._emit(req, out, [], req.checker.finish("length"), "length")
            return
        ids, text = req.checker.feed(tokens)
        if req.checker.finished:
            self._emit(req, out, ids, text, req.checker.finish_reason)
        elif ids or text:
            self._emit(req, out, ids, text, None)

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, GenerationEvent]]:
        """One engine step; returns the events it produced (also appended to ``req.events``)."""
        t0 = time.perf_counter()
        out: list = []
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            if req.cancelled:
                self._emit(req, out, [], req.checker.finish("cancelled"), "cancelled")
        admitted = self.scheduler.admit()
        if admitted:
            for req in admitted:
                t = time.perf_counter()
                self.runner.reset(req.slot)
                tokens = self.runner.prefill(req)
                req.t_decode = time.perf_counter()
                req.prefill_s = req.t_decode - t
                self._feed(req, tokens, out)
            self.last = StepInfo("prefill", len(admitted), len(admitted), time.perf_counter() - t0)
        elif self.scheduler.running:
            reqs = list(self.scheduler.running)
            results = self.runner.round(reqs)
            made = 0
            for req, tokens in zip(reqs, results):
                if tokens is not None:
                    req.rounds += 1
                    req.produced += len(tokens)
                    made += len(tokens)
                self._feed(req, tokens, out)
            info = self.runner.last
            self.last = StepInfo("decode", len(reqs), made, time.perf_counter() - t0, info.nodes, dict(info.kinds))
        self.steps += 1
        return out
