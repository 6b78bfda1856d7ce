"""`ddtree-server serve`: run the OpenAI-compatible HTTP server (uvicorn) on one model.

The HTTP listener starts first and the model loads on the worker thread, so /ready reports
loading / warming before it turns 200 (and `READY=1` goes to `$NOTIFY_SOCKET`). SIGTERM or SIGINT
drains: /ready says draining, new requests get 503, in-flight requests finish (at most
`--drain-timeout` seconds; then they are cancelled, finish_reason "cancelled"), then the process
exits 0. A second signal exits at once. A model that
fails to load or warm up (e.g. `--mode ddtree` without a usable drafter) makes the process exit 1
after one `error: ...` line (the traceback is logged at --log-level debug only); `--device cuda`
on a machine without CUDA exits 1 before anything loads.

The listening socket is bound BEFORE the model starts loading: a busy port or an unusable `--host`
prints one `error: cannot listen on HOST:PORT: reason` line and exits 1 at once (uvicorn would
otherwise fail after its lifespan had started the loading thread, and the interpreter could abort
while that thread was inside torch).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer

log = logging.getLogger("ddtree_server.serve")

# The engine thread and the HTTP event loop share the GIL. When the engine's CUDA synchronisation
# returns while the loop is busy streaming, it waits for the GIL until the loop's thread gives it
# up: at most the interpreter's switch interval (5 ms by default, as long as a whole batched
# round). A shorter interval hands it back sooner (DDTREE_SWITCH_INTERVAL, seconds).
SWITCH_INTERVAL_ENV = "DDTREE_SWITCH_INTERVAL"
SWITCH_INTERVAL = 0.0005
# the CUDA caching allocator's settings; the server's default unless the variable is set already
ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"


def load_engine(config: Any, status: Any, beacon: Any = None) -> Any:
    """Build the Engine for `config`; `status(text)` reports loading progress. `beacon`
    (engine/progress.py) watches the target's layers: progress inside a long prefill."""
    from ddtree_server.engine.factory import engine_from_config

    target = config.target or config.gguf or "the embedded SmolLM2 GGUF"
    status(f"loading {target} on {config.device} ({config.dtype})")
    engine = engine_from_config(config)
    limit = config.tree_budget_limit
    if engine.tree_budget is not None and engine.tree_budget > limit:
        log.warning("default tree budget %d lowered to --max-tree-budget %d", engine.tree_budget, limit)
        engine.tree_budget = limit
    if beacon is not None:
        beacon.watch(engine.target)
        beacon.watch(getattr(engine, "drafter", None))
    return engine


def warmup(engine: Any) -> None:
    """One short greedy generation in the default mode. Raises RuntimeError if it does not finish."""
    from ddtree_server.engine.params import SamplingParams

    ids = list(engine.tokenizer.encode("The capital of France is", add_special_tokens=True))
    last = None
    for last in engine.generate(ids, SamplingParams(max_tokens=4, temperature=0.0)):
        pass
    if last is None or last.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"warm-up generation did not finish (last event: {last!r})")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening-ready TCP sockets for `host`:`port` (one per address the host resolves to, like
    asyncio's create_server). Raises OSError (incl. socket.gaierror) when any cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(
                (i[0], i[1], i[2], "", i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def log_auth(config: Any) -> None:
    """One line saying whether /v1/* needs the API key (never the key itself)."""
    if config.api_key:
        log.info("authentication on: /v1/* needs Authorization: Bearer <the --api-key / $DDTREE_API_KEY key>")
    else:
        log.warning("authentication off: no API key (--api-key / $DDTREE_API_KEY unset or empty); /v1/* "
                    "answers every client that reaches %s:%d", config.host, config.port)


def run_server(config: Any) -> int:
    """Serve until SIGTERM/SIGINT. Returns the process exit status (0 drained, 1 load or bind failure)."""
    # a full server allocates blocks of many sizes round after round: without expandable segments
    # 2.2 GiB sat reserved but unusable when a 27B server with 150 slots ran out (docs/server.md)
    os.environ.setdefault(ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT)
    if config.device == "cuda":
        from ddtree_server.config import cuda_available

        if not cuda_available():   # known before anything loads: fail at once
            print("error: --device cuda: CUDA is not available on this machine (use --device cpu)",
                  file=sys.stderr, flush=True)
            return 1
    try:
        sockets = bind_sockets(config.host, config.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"error: cannot listen on {config.host}:{config.port}: {reason}", file=sys.stderr, flush=True)
        return 1
    import uvicorn

    from ddtree_server.api import sdnotify
    from ddtree_server.api.app import create_app
    from ddtree_server.api.metrics import Metrics
    from ddtree_server.api.worker import Worker
    from ddtree_server.engine.progress import Beacon

    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_auth(config)
    try:
        sys.setswitchinterval(float(os.environ.get(SWITCH_INTERVAL_ENV) or SWITCH_INTERVAL))
    except ValueError as exc:
        log.warning("%s ignored: %s", SWITCH_INTERVAL_ENV, exc)
    log.info("GIL switch interval %.2f ms", 1e3 * sys.getswitchinterval())
    metrics = Metrics()
    outcome = {"status": 0}
    server: Any = None

    def on_state(state: str, detail: str) -> None:
        metrics.state.state(state)
        sdnotify.on_state(state, detail)
        if state == "failed":
            outcome["status"] = 1
            if server is not None:
                server.should_exit = True

    def on_finished(job: Any, event: Any) -> None:
        stats = event.stats.to_dict() if event is not None and event.stats is not None else None
        metrics.observe_finished(prompt_tokens=len(job.prompt_ids), stats=stats,
                                 cancelled=job.cancel.is_set() or getattr(event, "finish_reason", None) == "cancelled")

    beacon = Beacon()
    worker = Worker(load=lambda status: load_engine(config, status, beacon), warmup=warmup,
                    max_queue=config.max_queue, max_concurrency=config.max_running or config.max_concurrency,
                    stall_seconds=config.stall_seconds, on_state=on_state, on_finished=on_finished,
                    progress=beacon.last, on_step=metrics.observe_step)
    app = create_app(config, worker, metrics)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                               log_level=config.log_level, timeout_graceful_shutdown=30)
    server = _server_class()(uv_config, worker=worker, drain_timeout=config.drain_timeout_s)
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    try:
        server.run(sockets=sockets)
    except SystemExit as exc:   # uvicorn's own start-up failure: never let the loading thread abort us
        code = exc.code if isinstance(exc.code, int) else 1
        log.error("server start-up failed (exit %d)", code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 1)
    if worker.state == "failed":
        outcome["status"] = 1
        print(f"error: the model could not be served: {worker.detail}", file=sys.stderr, flush=True)
    log.info("exiting with status %d", outcome["status"])
    leave(outcome["status"])
    return outcome["status"]   # not reached (leave exits)


def leave(status: int) -> None:
    """Exit the served process with `status` without finalising the interpreter: logs and the
    standard streams are flushed first, and nothing else is left to do (no atexit handlers; the
    drain answered every request and the worker stopped, or was given up on).

    After a second signal (which skips the lifespan shutdown) or a drain deadline that passed,
    the worker thread is still inside torch, and finalising the interpreter under it aborts the
    process (SIGABRT, "terminate called without an active exception"). After a clean drain,
    finalising only tears down torch and the model's objects one by one: ~1.5 s of every
    restart's downtime on a 2-core machine, for nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _server_class() -> type:
    """uvicorn.Server subclass with drain-on-signal (built here so that --help never imports uvicorn)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn.Server whose first SIGTERM/SIGINT drains the worker before shutting down."""

        def __init__(self, config: Any, *, worker: Any, drain_timeout: float) -> None:
            super().__init__(config)
            self._worker, self._drain_timeout, self._draining = worker, drain_timeout, False

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not recorded in _captured_signals: uvicorn would re-raise it and the exit status
            # would be -SIGTERM instead of 0 after a clean drain.
            if self._draining:
                log.warning("second signal %d: exiting without waiting", sig)
                self.force_exit = self.should_exit = True
                return
            self._draining = True
            log.info("signal %d: draining (at most %.0f s)", sig, self._drain_timeout)
            self._worker.begin_drain()
            threading.Thread(target=self._drain, name="ddtree-drain", daemon=True).start()

        def _drain(self) -> None:
            if not self._worker.wait_idle(self._drain_timeout):
                cancelled = self._worker.cancel_all()   # they end at their next round, answers complete
                log.warning("drain timeout: %d request(s) cancelled (finish_reason \"cancelled\")", cancelled)
                self._worker.wait_idle(10.0)
            self.should_exit = True

    return DrainingServer


def register(app: typer.Typer) -> None:
    """Add `serve` to the Typer app."""

    @app.command("serve")
    def serve(
        target: Optional[Path] = typer.Option(None, "--target", help="Hugging Face model folder of the target."),
        gguf: Optional[Path] = typer.Option(None, "--gguf", help="GGUF target file (default: embedded SmolLM2)."),
        drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter folder (default: shipped one)."),
        target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids",
                                                       help="Override the drafter's target layers, e.g. 1,9,17."),
        mode: Optional[str] = typer.Option(None, "--mode", help="ar | dflash | ddtree (default: best available)."),
        tree_budget: Optional[int] = typer.Option(None, "--tree-budget", help="DDTree node budget (nodes)."),
        spec_policy: str = typer.Option(
            "fixed", "--spec-policy",
            help="auto: choose each round's draft nodes over all ddtree requests (plain / chain / tree, one "
                 "global node budget, the tree budget a cap); fixed: every request's mode and budget as given."),
        spec_gate: str = typer.Option(
            "on", "--spec-gate",
            help="on: a round of speculative requests runs plainly when plain rounds are measured faster at that "
                 "batch size (a busy server, a poor drafter); off: every round runs the requests' modes."),
        max_tree_budget: Optional[int] = typer.Option(
            None, "--max-tree-budget",
            help="Largest decoding.tree_budget a request may ask for (nodes; above it: 400). Default 256 on "
                 "cuda (larger trees leave the CUDA graphs and slow every round), 64 on cpu (cost grows with "
                 "the node count), or --tree-budget when larger."),
        host: str = typer.Option("127.0.0.1", "--host", help="Listen address."),
        port: int = typer.Option(8000, "--port", help="Listen port."),
        device: Optional[str] = typer.Option(None, "--device", help="cuda | cpu (default: cuda if available)."),
        dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 | fp32 (default: bf16 cuda, fp32 cpu)."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DDTREE_API_KEY",
                                              help="Require this Bearer token on /v1/* (env DDTREE_API_KEY): visible ASCII without spaces; empty: no authentication."),
        served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Model id for clients."),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context window (tokens)."),
        max_queue: int = typer.Option(64, "--max-queue", help="Waiting requests before 429."),
        max_running: Optional[int] = typer.Option(
            None, "--max-running",
            help="Requests decoded together in one batched step (default: 4 on cpu, sized from free GPU "
                 "memory on cuda, at most 64)."),
        kv_memory_fraction: float = typer.Option(
            0.5, "--kv-memory-fraction",
            help="Without --max-running on cuda: the request slots may take this share of the free GPU "
                 "memory after loading (max running = share x free / bytes per slot, at most 64)."),
        kv_layout: str = typer.Option(
            "auto", "--kv-layout",
            help="slot: every request slot holds max-model-len tokens of K/V from start-up; paged: K/V in "
                 "pages of 16 tokens (a hybrid's GDN states per slot), admission by free pages, the newest "
                 "request preempted and recomputed when pages run out; auto: paged on cuda when slots at "
                 "max-model-len would not hold --max-running (default 64) requests, else slot."),
        kv_pages: Optional[int] = typer.Option(
            None, "--kv-pages",
            help="Paged layout: pages of 16 tokens, page 0 a dummy never handed out, so N - 1 hold tokens "
                 "(default and 0: cpu the slots' capacity, cuda what --kv-memory-fraction of the free memory "
                 "holds, a page holding the target's and the drafter's K/V)."),
        prefill_chunk: Optional[int] = typer.Option(
            None, "--prefill-chunk",
            help="Prompt tokens per engine step, interleaved with decode rounds so that a long prompt "
                 "never stalls running streams for more than one chunk (default 512 on cuda, 128 on cpu; "
                 "0: whole prompts)."),
        round_rows: Optional[int] = typer.Option(
            None, "--round-rows",
            help="Hybrid targets: rows of the round verify scratch, allocated once for all slots (default "
                 "1024, fewer for a few slots); a round's draft trees are cut to fit it."),
        max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", hidden=True,
                                                      help="Deprecated alias of --max-running."),
        chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs",
                                                           help='Default template kwargs as JSON, e.g. \'{"enable_thinking": false}\'.'),
        drain_timeout: float = typer.Option(120.0, "--drain-timeout", help="Longest drain on SIGTERM (s)."),
        stall_seconds: float = typer.Option(
            300.0, "--stall-seconds",
            help="/health answers 503 while one engine round has run this long (s): stuck, not busy."),
        log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
    ) -> None:
        """Serve the OpenAI-compatible API (chat, completions, streaming) with speculative decoding."""
        from pydantic import ValidationError

        from ddtree_server.config import ServerConfig
        from ddtree_server.commands.options import config_errors

        values = dict(target=target, gguf=gguf, drafter=drafter, target_layer_ids=target_layer_ids, mode=mode,
                      tree_budget=tree_budget, spec_policy=spec_policy, spec_gate=spec_gate, max_tree_budget=max_tree_budget, host=host, port=port, device=device, dtype=dtype, api_key=api_key,
                      served_model_name=served_model_name, max_model_len=max_model_len, max_queue=max_queue,
                      max_running=max_running if max_running is not None else max_concurrency,
                      kv_memory_fraction=kv_memory_fraction, prefill_chunk=prefill_chunk, round_rows=round_rows,
                      kv_layout=kv_layout, kv_pages=kv_pages,
                      chat_template_kwargs=chat_template_kwargs,
                      drain_timeout_s=drain_timeout, stall_seconds=stall_seconds, log_level=log_level)
        try:
            config = ServerConfig(**values)
        except ValidationError as exc:
            for line in config_errors(exc):
                typer.echo(line, err=True)
            raise typer.Exit(2) from None
        raise typer.Exit(run_server(config))
