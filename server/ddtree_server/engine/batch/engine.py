"""BatchEngine: one ``step()`` advances every running request by one round.

A step runs (1) at most ``prefill_chunk`` prompt tokens of the requests still prefilling (oldest
first; the chunks of several requests in one batched forward on dense targets and on the paged
layout, ``prefill.py``, else each request's chunk in one forward on its slot; a request's first token comes with its
last chunk) and then (2) one decode round over every request that was decoding when the step
began (plain, DFlash and DDTree requests in the same target forward: ``runner.py``). So a long
prompt arriving never holds running streams for more than one chunk: the time between two
tokens of a running request is at most one decode round plus one chunk's forward(s)
(docs/architecture.md, "Chunked prefill"). ``prefill_chunk`` None: every prompt whole in one
step. The host admits, streams and stops: stop rules per request (``StopChecker``), a cancelled
request ends at the next step boundary, a finished one frees its slot for the next waiting request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ddtree_server.engine.batch.admission import PageAdmission
from ddtree_server.engine.batch.prefill import prefill_many
from ddtree_server.engine.batch.request import GenerationEvent, Request
from ddtree_server.engine.batch.runner import StepRunner
from ddtree_server.engine.batch.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class StepInfo:
    """What the last step did: ``kind`` prefill (prompt chunks only) / decode (a round only) /
    mixed (both) / idle, requests in it, tokens it produced (first tokens included), seconds;
    ``prefill_tokens`` prompt tokens it ran in ``prefill_seconds``; for a decode round also its
    draft nodes over all requests (``nodes``, N) and requests per tree kind (``kinds``: plain /
    chain / tree)."""

    kind: str = "idle"
    batch: int = 0
    tokens: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    nodes: int = 0
    kinds: dict | None = None


@dataclass(frozen=True)
class SlotMemory:
    """The slots' memory after the last step (a snapshot other threads may read): ``slots``
    (max_running) of which ``used`` hold a request, ``slot_bytes`` per slot (the target's KV and
    GDN state, the drafter's context K/V, allocated once at max_model_len), KV rows (cached
    tokens) of the running requests of ``kv_rows_capacity`` (slots x rows per slot), requests
    still ``prefilling``, ``scratch_bytes`` allocated once for all slots (a hybrid's round verify
    scratch); the batched CUDA graphs' ``graph_pool_bytes``, the largest eager round's
    ``eager_reserve_bytes`` they keep free, ``graphs_captured`` and ``graph_declined_rounds``
    (rounds that ran eagerly because memory was short for a capture: ``graph_pool.py``). The
    paged layout: ``page_bytes`` per page of 16 rows, pages used / free, ``preemptions`` so far
    (zeros in the slot layout)."""

    slots: int
    used: int
    slot_bytes: int
    kv_rows_used: int
    kv_rows_capacity: int
    prefilling: int = 0
    scratch_bytes: int = 0
    graph_pool_bytes: int = 0
    eager_reserve_bytes: int = 0
    graphs_captured: int = 0
    graph_declined_rounds: int = 0
    page_bytes: int = 0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    preemptions: int = 0


class BatchEngine:
    """Scheduler + step runner; see the module docstring. Not thread-safe (one worker thread)."""

    def __init__(self, target, drafter, *, max_running: int, max_len: int, device, poison: bool = False,
                 graphs: bool | None = None, prefill_chunk: int | None = None, policy=None, gate=None,
                 round_rows: int | None = None, pages: int | None = None):
        """``pages``: the target's K/V in this many pages of 16 rows (the paged layout: admission
        and look-ahead by pages, preemption by recompute; ``admission.py``), None: slots."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 tokens (None: whole prompts), got {prefill_chunk}")
        self.scheduler = Scheduler(max_running)
        self.runner = StepRunner(target, drafter, slots=max_running, max_len=max_len, device=device,
                                 poison=poison, graphs=graphs, policy=policy, rows=round_rows, pages=pages)
        self.admission = PageAdmission(self.runner.caches, self.runner.block_size) if self.runner.paged else None
        self.preemptions = 0
        # targets without our forward (transformers runner) prefill whole prompts
        self.prefill_chunk = prefill_chunk if self.runner.kind is not None else None
        self.block_size = self.runner.block_size
        self.max_len = max_len
        self.slot_bytes = self.runner.caches.slot_bytes + (
            self.runner.dcaches.slot_bytes if self.runner.dcaches is not None else 0)
        self.scratch_bytes = self.runner.scratch.nbytes if self.runner.scratch is not None else 0
        # the speculation gate (gate.py): plain rounds where they are measured faster; None: never
        self.gate = gate if self.runner.drafter is not None else None
        self.last = StepInfo()
        self.steps = 0
        self.memory = self._memory()

    def _memory(self) -> SlotMemory:
        running, gp, adm = self.scheduler.running, self.runner.graph_pool, self.admission
        pages = adm.pages if adm is not None else None
        capacity = (pages.num_pages - 1) * pages.page_size if pages else self.max_running * self.max_len
        return SlotMemory(self.max_running, len(running), self.slot_bytes,
                          sum(max(r.s, r.prefilled) for r in running), capacity,
                          self.scheduler.prefilling, self.scratch_bytes, gp.pool_bytes, gp.reserve, gp.captured,
                          gp.refused, adm.slots.page_bytes if adm else 0, pages.used_pages if pages else 0,
                          pages.free_pages if pages else 0, self.preemptions)

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
            self.memory = self._memory()

    def _release(self, req: Request) -> None:
        slot = self.scheduler.release(req)
        if slot is not None:
            self.runner.free(slot)
        req.ctx, req.ctx_parts = None, []

    def _preempt(self, req: Request) -> None:
        """Back to the queue by recompute (its pages freed; ``Request.preempt``)."""
        slot = self.scheduler.requeue(req)
        self.runner.free(slot)
        req.preempt()
        self.preemptions += 1
        pages = self.runner.caches.pages
        log.info("KV pages ran out: request %s preempted, %d tokens to recompute on re-admission "
                 "(%d preemptions so far; %d of %d pages free)", req.rid, len(req.prefill_ids), self.preemptions,
                 pages.free_pages, pages.num_pages - 1)

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
        take = None if self.admission is None else \
            (lambda req, slot: self.admission.take(req, slot, len(self.scheduler.running)))
        for req in self.scheduler.admit(take):
            self.runner.reset(req.slot)
        decoding = self.scheduler.decoding()   # before this step's chunks: new requests join next step
        made = ptoks = 0
        chunks = self.scheduler.chunks(self.prefill_chunk)
        if (self.runner.kind == "dense" and len(chunks) > 1) or (chunks and self.runner.paged):   # one forward (prefill.py)
            t = time.perf_counter()
            done = prefill_many(self.runner, chunks)
            times = [(t, time.perf_counter())] * len(chunks)
        else:
            done, times = [], []
            for req, n in chunks:
                t = time.perf_counter()
                done.append(self.runner.prefill(req, n))
                times.append((t, time.perf_counter()))
        for (req, n), tokens, (t, now) in zip(chunks, done, times):
            req.prefill_s += now - t   # the prompt's forwards (interleaved rounds not counted)
            ptoks += n
            if tokens:   # the first token (a preempted request's recompute brings none)
                req.t_decode = now
                made += 1
                self._feed(req, tokens, out)
        t_prefill = time.perf_counter() - t0
        if decoding:
            gated = self.gate is not None and any(r.mode != "ar" for r in decoding)
            speculate = self.gate.choose(len(decoding)) if gated else True
            if self.admission is not None:   # pages for the round's rows; the newest preempted if short
                self.admission.plan(list(self.scheduler.running), decoding, speculate, self.runner.room, self._preempt)
                decoding = [r for r in decoding if r.slot is not None]
        if decoding:
            t_round, made_before = time.perf_counter(), made
            results = self.runner.round(decoding, speculate)
            for req, tokens in zip(decoding, results):
                if tokens is not None:
                    req.rounds += 1
                    req.produced += len(tokens)
                    made += len(tokens)
                self._feed(req, tokens, out)
            if gated:
                self.gate.observe(len(decoding), speculate, made - made_before, time.perf_counter() - t_round)
        kind = ("mixed" if decoding else "prefill") if chunks else "decode" if decoding else "idle"
        info = self.runner.last if decoding else None
        self.last = StepInfo(kind, len(decoding) + len(chunks), made, time.perf_counter() - t0, ptoks, t_prefill,
                             info.nodes if info else 0, dict(info.kinds) if info else None)
        self.steps += 1
        self.memory = self._memory()
        return out
