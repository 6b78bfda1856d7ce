"""FastAPI app factory: the routes of the OpenAI-compatible server and its error shapes.

Routes: GET /health, /ready, /metrics, /openapi.json, /v1/models[/{id}]; POST
/v1/chat/completions, /v1/completions. /health and /ready report how old the engine round in
progress and the oldest queued request are (busy vs stuck); /health is 503 while a round has
shown no progress for --stall-seconds (a long prefill moving layer by layer is progress). Every
error is `{"error": {message, type, param, code}}`; request validation errors are 400 (not
FastAPI's 422); everything a client can get wrong is decided before the first byte of a stream.
With an API key, /v1/* needs `Authorization: Bearer <key>` (401); /health, /ready, /metrics and
/openapi.json (api/openapi.py) stay open. A request body over MAX_BODY_BYTES (api/middleware.py)
is a 413 before it is parsed; a prompt whose characters cannot fit the context window is a 400
before it is tokenised (api/prompts.py).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree_server.api import openapi, prompts
from ddtree_server.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from ddtree_server.api.metrics import Metrics
from ddtree_server.api.middleware import Middleware
from ddtree_server.api.responses import (ApiError, chat_response, completion_response, error_body, model_card,
                                         new_id, now)
from ddtree_server.api.schemas import ChatCompletionRequest, CompletionRequest
from ddtree_server.api.streaming import HEADERS, MEDIA_TYPE, ChunkShape, event_stream
from ddtree_server.api.worker import Job, NotAccepting, QueueFull, Rejected, Worker
from ddtree_server.config import ServerConfig

log = logging.getLogger("ddtree_server.api")

DISCONNECT_POLL_S = 0.25   # how often a waiting request checks whether its client left (s)
_PENDING = object()


class ClientGone(Exception):
    """The client closed the connection before the response started."""


def available_modes(engine: Any) -> set[str]:
    """Decoding modes this engine can run: ar always; dflash and ddtree with a drafter on a
    target that can verify trees (`Engine.spec_available`)."""
    return {"ar", "dflash", "ddtree"} if getattr(engine, "spec_available", False) else {"ar"}


def vocab_size(engine: Any) -> int:
    """Token ids a prompt may use: below both the model's embedding rows and the tokenizer size."""
    sizes = [len(engine.tokenizer)]
    model_vocab = getattr(getattr(getattr(engine, "target", None), "config", None), "vocab_size", None)
    if model_vocab:
        sizes.append(int(model_vocab))
    return min(sizes)


def model_type(engine: Any) -> str | None:
    """The target's `config.model_type` (chooses the tool-call format with the chat template)."""
    return getattr(getattr(getattr(engine, "target", None), "config", None), "model_type", None)


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {}
    # a union field (a message's content: string or text parts): a part of the wrong kind fails
    # deeper than the string branch's type mismatch, and says more ("...content.0.type: Input should be 'text'")
    deeper = [e for e in errors if e.get("type") == "literal_error"
              and len(e.get("loc", ())) > len(first.get("loc", ()))]
    if str(first.get("type", "")).endswith("_type") and deeper:
        first = deeper[0]
    # drop pydantic's union-branch tags ("str", "list[int]", "function-after[...]") from the path
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _BRANCH_TAGS
           and "[" not in str(p)]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if tuple(first.get("loc", ())) == ("body",):    # the body as a whole: absent, or not an object
        if first.get("type") == "missing":
            return "the request body is empty: send a JSON object (Content-Type: application/json)", None
        return ("the request body must be a JSON object, sent with Content-Type: application/json "
                "(other content types are not parsed)"), None
    if first.get("type") == "missing":
        return f"missing required field {param!r}", param
    return (f"{param}: {msg}" if param else msg), param


def _parse_failure(exc: BaseException) -> str:
    """Why json.loads refused a body, in one short clause."""
    if isinstance(exc, UnicodeDecodeError):
        return f"invalid {exc.encoding.upper()} at byte {exc.start} ({exc.reason})"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0] or type(exc).__name__


def create_app(config: ServerConfig, worker: Worker, metrics: Metrics) -> FastAPI:
    """The ASGI app; its lifespan starts the worker (model load in the background) and stops it."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()   # loads the model on the worker thread; the listener is up meanwhile
        yield
        worker.stop()

    app = FastAPI(title="ddtree-server", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "5"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:   # FastAPI could not decode the body
            message = f"the request body is not valid JSON: {_parse_failure(exc.__cause__)}"
        return JSONResponse(error_body(message, code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))   # e.g. Allow on a 405

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"),
                            status_code=500)

    def ready_engine() -> Any:
        if worker.state != "ready":
            raise ApiError(503, f"the server is {worker.state}: {worker.detail}", type="service_unavailable",
                           code=worker.state)
        return worker.engine

    def check_model(name: str | None, engine: Any) -> None:
        if name is not None and name != engine.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {engine.model_id!r}",
                           param="model", code="model_not_found")

    def load() -> dict[str, Any]:
        """The worker's load: ages in seconds (None when nothing runs / waits), counts."""
        def seconds(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {"round_age_s": seconds(worker.round_age()), "quiet_s": seconds(worker.quiet_age()),
                "oldest_queued_age_s": seconds(worker.oldest_queued_age()),
                "running": worker.running, "queued": worker.queued, "stall_seconds": worker.stall_seconds,
                "stalled": worker.stalled()}

    app.openapi = lambda: openapi.document(app, api_key=bool(config.api_key),
                                           max_tree_budget=config.tree_budget_limit)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_route() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = worker.unhealthy_reason()
        body = {"status": "ok" if reason is None else "unhealthy", "state": worker.state, "reason": reason, **load()}
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"state": worker.state, "detail": worker.detail, "elapsed_s": round(worker.elapsed(), 3), **load()}
        return JSONResponse(body, status_code=200 if worker.state == "ready" else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        metrics.queue_depth.set(worker.queued)
        metrics.running.set(worker.running)
        metrics.round_age.set(worker.round_age() or 0.0)
        metrics.oldest_queued_age.set(worker.oldest_queued_age() or 0.0)
        metrics.stalled.set(1 if worker.stalled() else 0)
        metrics.observe_memory(getattr(getattr(worker.engine, "batch", None), "memory", None))
        return Response(metrics.render(), media_type=metrics.content_type)

    def card(engine: Any) -> dict[str, Any]:
        # Only folder / file names: never the host's absolute paths.
        drafter = None
        if getattr(engine, "drafter", None) is not None:
            drafter = (config.drafter.resolve().name or "default") if config.drafter else "default"
        source = config.target or config.gguf
        target = (source.resolve().name or "default") if source else "default"
        extra = {"target": target, "drafter": drafter,
                 "decoding": {"default_mode": engine.default_mode, "modes": sorted(available_modes(engine)),
                              "tree_budget": getattr(engine, "tree_budget", None),
                              "max_tree_budget": config.tree_budget_limit,
                              "block_size": getattr(engine, "block_size", None)}}
        return model_card(model_id=engine.model_id, created=int(time.time() - worker.elapsed()),
                          max_model_len=engine.max_model_len, extra=extra)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card(ready_engine())]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        engine = ready_engine()
        check_model(model_id, engine)
        return card(engine)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        engine = ready_engine()
        check_model(body.model, engine)
        prompt = await run_in_threadpool(prompts.chat_prompt, engine.tokenizer, body, config.chat_template_kwargs,
                                         model_type(engine), engine.max_model_len)
        return await _generate(request, engine, body, prompt.ids, "chat", parser=prompt.parser, markup=prompt.markup)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = ready_engine()
        check_model(body.model, engine)
        ids = await run_in_threadpool(prompts.completion_prompt_ids, engine.tokenizer, body.prompt,
                                      vocab_size(engine), engine.max_model_len)
        return await _generate(request, engine, body, ids, "completion")

    async def _generate(request: Request, engine: Any, body: Any, ids: list[int], kind: str,
                        parser: Any = None, markup: str | None = None) -> Response:
        limit = config.tree_budget_limit
        mode, budget = prompts.check_decoding(body, available_modes(engine), limit)
        if budget is None and (getattr(engine, "tree_budget", None) or 0) > limit:
            budget = limit   # the engine's default never exceeds --max-tree-budget either
        from ddtree_server.engine.params import SamplingParams

        grammar = await run_in_threadpool(prompts.grammar_for, engine, body, markup)
        params = prompts.sampling_params(body, len(ids), engine.max_model_len, SamplingParams,
                                         getattr(engine, "sampling_defaults", None),
                                         vocab_size=vocab_size(engine), grammar=grammar)
        format_logprobs = None
        if params.logprobs is not None:
            format_logprobs = await run_in_threadpool(logprob_formatter, engine, kind)
        rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
        jobs = [Job(rid=rid if body.n == 1 else f"{rid}-{i}", prompt_ids=ids, tree_budget=budget, mode=mode,
                    params=params if params.seed is None or i == 0 else
                    dataclasses.replace(params, seed=(params.seed + i) % 2**64))
                for i in range(body.n)]
        try:
            for job in jobs:
                worker.submit(job)
        except QueueFull as exc:
            for job in jobs:
                job.cancel.set()
            raise ApiError(429, f"the server is busy: {exc}; retry later", type="rate_limit_error",
                           code="queue_full") from None
        except NotAccepting as exc:
            for job in jobs:
                job.cancel.set()
            raise ApiError(503, f"the server is {exc}", type="service_unavailable", code=str(exc)) from None
        try:
            firsts = [await _next(job, request) for job in jobs]
        except ClientGone:
            for job in jobs:
                job.cancel.set()
            return Response(status_code=499)
        except Rejected as exc:
            for job in jobs:
                job.cancel.set()
            raise ApiError(400, str(exc)) from None
        except Exception as exc:
            for job in jobs:
                job.cancel.set()
            log.exception("request %s failed", rid)
            raise ApiError(500, f"generation failed: {exc}", type="server_error") from None
        if any(first is None for first in firsts) and all(job.cancel.is_set() for job in jobs):
            # cancelled while queued (the drain deadline): never ran
            raise ApiError(503, "the server is shutting down: the request was cancelled before it started; retry",
                           type="service_unavailable", code="draining")
        if any(first is None for first in firsts):   # the engine ended without a final event (never expected)
            raise ApiError(500, "the generation produced no result", type="server_error")
        metrics.ttft.observe(time.monotonic() - jobs[0].submitted_at)
        # one output parser per choice (a parser keeps the state of its text)
        parsers = [parser] + [copy.deepcopy(parser) for _ in range(body.n - 1)]
        created, model = now(), engine.model_id
        if body.stream:
            shape = ChunkShape(kind, rid, created, model, body.include_usage(), format_logprobs)

            def on_close(finished: bool) -> None:
                if not finished and not all(job.cancel.is_set() for job in jobs):
                    log.info("request %s: client disconnected during the stream", rid)
                    for job in jobs:
                        job.cancel.set()

            nexts = [(lambda job=job: job.next_event()) for job in jobs]
            many = body.n > 1
            stream = event_stream(shape, firsts if many else firsts[0], nexts if many else nexts[0],
                                  prompt_tokens=len(ids), on_close=on_close, parser=parsers if many else parsers[0])
            return StreamingResponse(stream, media_type=MEDIA_TYPE, headers=HEADERS)
        texts, reasons, all_stats, all_lps, messages, tokens = [], [], [], [], [], 0
        for job, event, parser in zip(jobs, firsts, parsers):
            parts, lps, last = [], [], event
            while event is not None:
                parts.append(event.text)
                lps += event.logprobs or []
                last = event
                try:
                    event = await _next(job, request)
                except ClientGone:
                    for other in jobs:
                        other.cancel.set()
                    return Response(status_code=499)
            stats = last.stats.to_dict() if last.stats is not None else None
            tokens += stats["generated_tokens"] if stats else 0
            text, finish, message = "".join(parts), last.finish_reason, None
            if kind == "chat" and parser is not None and parser.active:
                parser.feed(text)
                parser.finish()
                finish, message = parser.finish_reason(finish), parser.message()
            texts.append(text)
            reasons.append(finish)
            messages.append(message)
            all_stats.append(stats)
            all_lps.append(format_logprobs(lps) if format_logprobs else None)
        many = body.n > 1
        common = dict(rid=rid, created=created, model=model, text=texts if many else texts[0],
                      finish_reason=reasons if many else reasons[0], prompt_tokens=len(ids),
                      completion_tokens=tokens, decoding=all_stats[0], logprobs=all_lps if many else all_lps[0])
        if kind != "chat":
            return JSONResponse(completion_response(**common))
        return JSONResponse(chat_response(message=messages if many else messages[0], **common))

    def logprob_formatter(engine: Any, kind: str) -> Any:
        """entries -> the API's logprobs object (token texts read once per engine)."""
        texts = getattr(app.state, "token_texts", None)
        if texts is None or texts[0] is not engine:
            app.state.token_texts = texts = (engine, TokenTexts(engine))
        if kind == "chat":
            return lambda entries, offset=0: chat_logprobs(texts[1], entries)
        return lambda entries, offset=0: completion_logprobs(texts[1], entries, offset)

    async def _next(job: Job, request: Request) -> Any:
        """The job's next event; cancels the job and raises ClientGone when the client has left
        (checked at least every DISCONNECT_POLL_S seconds, also while events keep coming)."""
        while True:
            due = job.submitted_at + DISCONNECT_POLL_S * (1 + int((time.monotonic() - job.submitted_at)
                                                                  / DISCONNECT_POLL_S))
            try:
                event = await job.next_event(timeout=max(due - time.monotonic(), 0.01))
            except asyncio.TimeoutError:
                event = _PENDING
            if time.monotonic() >= due and await request.is_disconnected():
                log.info("request %s: client disconnected before the response", job.rid)
                job.cancel.set()
                raise ClientGone()
            if event is not _PENDING:
                return event

    app.add_middleware(Middleware, api_key=config.api_key, metrics=metrics)
    return app
