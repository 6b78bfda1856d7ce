"""The request queue and the single worker thread that owns the (not thread-safe) Engine.

Life cycle (`Worker.state`): loading -> warming -> ready -> draining -> stopped, or failed when the
model cannot be loaded or warmed up. The thread loads the engine itself, so the HTTP listener can
answer /health and /ready while the weights load.

Requests are `Job`s: the asyncio side submits them (`submit`, never blocks) and awaits their events
(`Job.next_event`). The worker admits up to `max_concurrency` jobs into the engine's batch engine
(``engine.batch``, engine/batch/) and calls its `step()` in a loop: one step advances every
running job by one round (or prefills the jobs just admitted), and the worker hands every
`GenerationEvent` back through its job's event loop. Setting `Job.cancel` stops a generation at
the next step (finish_reason "cancelled").

Busy or stuck: `round_age()` is how long the engine step in progress (a prefill step or one
batched decode round) has run, `oldest_queued_age()` how long the oldest request not yet started
has waited (seconds, None when there is none). A step that has shown no progress for
`stall_seconds` makes `alive()` False (/health 503): one round of a capped tree budget takes well
under a second on a GPU, so a step that runs for minutes is stuck, not busy; a long queue with
young steps is busy. A long prompt's prefill is one step that may take minutes: the optional
`progress()` clock (engine/progress.py: the last time a model layer started) counts as progress
inside it, so a prefill that moves layer by layer is busy, not stuck (`quiet_age()`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("ddtree_server.worker")

STALL_SECONDS = 300.0   # default: /health fails when one engine round has run this long (s)
_END = object()             # delivered after a job's last event


class NotAccepting(Exception):
    """The worker takes no new jobs: not ready yet, draining, stopped or failed (HTTP 503)."""


class QueueFull(Exception):
    """`max_queue` jobs are already waiting (HTTP 429)."""


class Rejected(Exception):
    """The engine refused the request before generating (its ValueError; HTTP 400)."""


@dataclass
class Job:
    """One generation request as the worker sees it; create it on the event loop's thread."""

    rid: str
    prompt_ids: list[int]
    params: Any                      # engine.sampling.SamplingParams
    mode: str | None = None
    tree_budget: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.monotonic)
    first_event_at: float | None = None

    def deliver(self, item: Any) -> None:
        """Hand an event (or an exception, or the end marker) to the awaiting request (any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            self.cancel.set()

    async def next_event(self, timeout: float | None = None) -> Any:
        """The next GenerationEvent; None after the last one.

        Raises the engine's exception if the generation failed, `asyncio.TimeoutError` when nothing
        arrived within `timeout` seconds (the job keeps running).
        """
        item = await asyncio.wait_for(self.events.get(), timeout)
        if item is _END:
            self.events.put_nowait(_END)   # stay at the end for repeated calls
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class Worker:
    """Owns the engine on one thread and serves `Job`s from a bounded queue.

    `load(status)` builds the engine (it may call `status(text)` to report progress);
    `warmup(engine)` runs one short generation; `on_state(state, detail)` is called on every state
    change (from the worker thread or the caller of `begin_drain`/`stop`); `on_finished(job, event)`
    after each job's final event (metrics); `on_step(info)` after each batched step with the
    engine's `StepInfo` (batch size, tokens, seconds); `stall_seconds`: a step running this long
    is stuck. `max_concurrency` None: the engine's own limit (its `max_concurrency`).
    """

    def __init__(self, *, load: Callable[[Callable[[str], None]], Any], warmup: Callable[[Any], None],
                 max_queue: int = 64, max_concurrency: int | None = None, stall_seconds: float = STALL_SECONDS,
                 on_state: Callable[[str, str], None] | None = None,
                 on_finished: Callable[[Job, Any], None] | None = None,
                 on_step: Callable[[Any], None] | None = None,
                 progress: Callable[[], float | None] | None = None) -> None:
        self._load, self._warmup = load, warmup
        self._queue: queue.Queue[Job] = queue.Queue()   # bounded in submit: max_queue + free slots
        self._max_queue, self._max_concurrency = max_queue, max_concurrency
        self.stall_seconds = float(stall_seconds)
        self._waiting: dict[str, float] = {}       # rid -> submitted_at of queued jobs, oldest first
        self._jobs: dict[str, Job] = {}            # rid -> every job submitted and not finished
        self._round_started: float | None = None   # monotonic start of the round in progress
        self._on_state = on_state or (lambda state, detail: None)
        self._on_finished = on_finished or (lambda job, event: None)
        self._on_step = on_step or (lambda info: None)
        self._progress = progress or (lambda: None)   # monotonic time of the last progress inside a round
        self._lock = threading.Lock()
        self._running = 0    # jobs the thread is generating
        self._inflight = 0   # jobs submitted and not finished (queued + running)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="ddtree-worker", daemon=True)
        self.engine: Any = None
        self.state, self.detail = "loading", "starting"
        self.started_at = time.monotonic()

    # ---- control (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (loads the model in the background)."""
        self._set_state("loading", "loading the model")
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job. Raises NotAccepting (503) unless ready, QueueFull (429) when full."""
        with self._lock:
            if self.state != "ready":
                raise NotAccepting(self.state)
            # jobs in the queue that free engine slots will take at the next step boundary are not
            # waiting: a burst that arrives during one step fills the free slots, then the queue
            free = max((self._max_concurrency or 1) - self._running, 0)
            if self._queue.qsize() >= self._max_queue + free:
                raise QueueFull(f"{self._max_queue} requests are already waiting")
            self._queue.put_nowait(job)
            self._inflight += 1
            self._waiting[job.rid] = job.submitted_at
            self._jobs[job.rid] = job

    def begin_drain(self) -> None:
        """Refuse new jobs from now on; queued and running jobs still complete."""
        with self._lock:
            if self.state in ("ready", "loading", "warming"):
                self._set_state("draining", "finishing in-flight requests")

    def cancel_all(self) -> int:
        """Cancel every queued and running job (each ends at its next engine round with
        finish_reason "cancelled", a stream with its last chunk); returns how many. The drain uses
        it when its deadline passes, so that no request is cut off by the process exit."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.cancel.set()
        return len(jobs)

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is queued or running (True) or `timeout` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while self._inflight:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread once its queue is empty; waits up to `timeout` seconds for it to exit."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.state != "failed":
            self._set_state("stopped", "stopped")

    # ---- status -------------------------------------------------------------------------------
    def thread_alive(self) -> bool:
        """True while the worker thread runs (after `stop`: a generation or load it could not end)."""
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

    def round_age(self) -> float | None:
        """Seconds the engine round in progress has run; None when no round runs."""
        started = self._round_started
        return None if started is None else max(time.monotonic() - started, 0.0)

    def oldest_queued_age(self) -> float | None:
        """Seconds the oldest queued (not yet started) request has waited; None when none waits."""
        with self._lock:
            oldest = next(iter(self._waiting.values()), None)
        return None if oldest is None else max(time.monotonic() - oldest, 0.0)

    def quiet_age(self) -> float | None:
        """Seconds since the round in progress started or last showed progress (`progress()`);
        None when no round runs."""
        started, beat = self._round_started, self._progress()
        if started is None:
            return None
        return max(time.monotonic() - max(started, beat if beat is not None else started), 0.0)

    def stalled(self) -> bool:
        """True while the round in progress has shown no progress for `stall_seconds` or longer."""
        age = self.quiet_age()
        return age is not None and age >= self.stall_seconds

    def unhealthy_reason(self) -> str | None:
        """Why the worker is not alive (None when it is): thread gone, failed, or a stuck round."""
        if self.state == "failed":
            return f"failed: {self.detail}"
        if not self._thread.is_alive():
            return "the worker thread is not running"
        quiet = self.quiet_age()
        if self.state not in ("loading", "warming") and quiet is not None and quiet >= self.stall_seconds:
            return (f"stalled: the engine round in progress has run {self.round_age() or 0.0:.1f} s, "
                    f"{quiet:.1f} s without progress (--stall-seconds {self.stall_seconds:g})")
        return None

    def alive(self) -> bool:
        """Liveness: the thread runs, the state is not failed and no engine round is stuck."""
        return self.unhealthy_reason() is None

    def elapsed(self) -> float:
        """Seconds since the worker was created."""
        return time.monotonic() - self.started_at

    def _set_state(self, state: str, detail: str) -> None:
        if self.state in ("draining", "stopped", "failed") and state in ("loading", "warming", "ready"):
            return   # a drain or failure is final
        self.state, self.detail = state, detail
        log.info("state %s: %s", state, detail)
        try:
            self._on_state(state, detail)
        except Exception:  # a failing observer must not kill the worker
            log.exception("state observer failed")

    # ---- the worker thread --------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.engine = self._load(lambda text: self._set_state("loading", text))
            cap = int(getattr(self.engine, "max_concurrency", 1))
            if self._max_concurrency is None:
                self._max_concurrency = cap
            elif self._max_concurrency > cap:
                log.warning("the engine runs %d request(s) at a time; max_concurrency %d lowered to %d",
                            cap, self._max_concurrency, cap)
                self._max_concurrency = cap
            self._set_state("warming", "warm-up generation")
            self._warmup(self.engine)
        except Exception as exc:
            # One line (operators read it in journald); the traceback only at --log-level debug.
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())
            log.error("model load / warm-up failed: %s", detail)
            log.debug("model load / warm-up traceback", exc_info=True)
            self._set_state("failed", detail)
            return
        with self._lock:
            if self.state == "warming":
                self._set_state("ready", "ready")
        self._serve()

    def _serve(self) -> None:
        """Admit jobs into the batch engine and step it; one step advances every running job."""
        batch, jobs = self.engine.batch, {}
        while True:
            self._admit(batch, jobs)
            if not jobs:
                if self._stop.is_set() and self._queue.empty():
                    return
                continue
            self._round_started = time.monotonic()
            try:
                out = batch.step()
            except Exception as exc:   # a failed step fails every job in it; the engine is reset
                log.exception("engine step failed")
                for req, job in list(jobs.values()):
                    batch.abort(req)
                    self._finish(job, None, cancelled=False, last=exc)
                    self._end_running()
                jobs.clear()
                continue
            finally:
                self._round_started = None
            try:
                self._on_step(batch.last)
            except Exception:
                log.exception("step observer failed")
            for req, event in out:
                req.events.clear()
                job = jobs[req.rid][1]
                if job.first_event_at is None:
                    job.first_event_at = time.monotonic()
                if event.finish_reason is None:
                    job.deliver(event)
                else:
                    del jobs[req.rid]
                    self._finish(job, event, cancelled=event.finish_reason == "cancelled", last=event)
                    self._end_running()

    def _end_running(self) -> None:
        with self._lock:
            self._running -= 1

    def _admit(self, batch, jobs: dict) -> None:
        while len(jobs) < self._max_concurrency:
            try:
                job = self._queue.get(timeout=0.2) if not jobs else self._queue.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._running += 1
                self._waiting.pop(job.rid, None)
            if job.cancel.is_set():   # the client left while the job waited
                self._finish(job, None, cancelled=True)
                self._end_running()
                continue
            try:
                req = self.engine.make_request(job.prompt_ids, job.params, mode=job.mode,
                                               tree_budget=job.tree_budget, cancel=job.cancel, rid=job.rid)
            except Exception as exc:   # the engine validates before generating
                self._finish(job, None, cancelled=False, last=Rejected(str(exc)) if isinstance(exc, ValueError) else exc)
                self._end_running()
                continue
            batch.add(req)
            jobs[job.rid] = (req, job)

    def _finish(self, job: Job, event: Any, *, cancelled: bool, last: Any = None) -> None:
        """End a job: the observer first (metrics), then its ``last`` item (final event or error)
        and the end marker, so /metrics read after a response already counts that request."""
        if cancelled:
            log.info("request %s cancelled (client disconnected or drain deadline)", job.rid)
        try:
            self._on_finished(job, event)
        except Exception:
            log.exception("finish observer failed")
        if last is not None:
            job.deliver(last)
        job.deliver(_END)
        with self._lock:
            self._inflight -= 1
            self._jobs.pop(job.rid, None)
