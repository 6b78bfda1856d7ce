"""The real API app over a real tiny Engine, in-process (no model download, ~1 s to build).

`TinyApp` starts a real `Worker` over an `Engine` with a random 4-layer Qwen3 target
(tests/server/tiny.py) and the `TableDrafter` test double, builds the app with `create_app` and
sends requests through httpx's ASGI transport (header values and bodies as raw bytes). Used by
the hostile-body suite, the schemathesis run and the health / tree-budget tests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx

from ddtree_server.api.app import create_app
from ddtree_server.api.metrics import Metrics
from ddtree_server.api.worker import Worker
from ddtree_server.config import ServerConfig
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, TableDrafter

MODEL_ID = "tiny"
MAX_MODEL_LEN = 96
REQUEST_TIMEOUT_S = 60.0   # any request slower than this counts as a hang


class TinyTokenizer(ByteTokenizer):
    """ByteTokenizer with a size (the app's vocabulary check) and a chat template (chat route)."""

    chat_template = "<role>content</role> per message (ByteTokenizer.apply_chat_template)"

    def __len__(self) -> int:
        return VOCAB


class StallingDrafter(TableDrafter):
    """TEST DOUBLE of a stuck device: once `armed` is set, `propose` blocks until `gate` is set
    (a round that never finishes on its own), and sets `stuck` while it waits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.armed, self.gate, self.stuck = threading.Event(), threading.Event(), threading.Event()

    def propose(self, cache, ctx, bonus_token, start_pos):
        if self.armed.is_set():
            self.stuck.set()
            self.gate.wait(120)
        return super().propose(cache, ctx, bonus_token, start_pos)


_TARGET: list[Any] = []


def tiny_engine(drafter: Any = None, *, tree_budget: int | None = None) -> Any:
    """An Engine over one shared random tiny target (built once per process)."""
    import torch

    from ddtree_server.engine.engine import Engine
    from tests.server.tiny import tiny_target

    torch.set_num_threads(1)
    if not _TARGET:
        _TARGET.append(tiny_target())
    drafter = drafter or TableDrafter([[1, 2], [3]], vocab=VOCAB, hidden=64, layer_ids=[1, 2])
    return Engine(_TARGET[0], TinyTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_MODEL_LEN,
                  model_id=MODEL_ID, tree_budget=tree_budget)


class TinyApp:
    """A started worker + app; `request()` runs one request (raises on a hang), `stop()` ends it."""

    def __init__(self, engine: Any = None, *, stall_seconds: float | None = None, start: bool = True,
                 on_finished: Any = None, **config: Any) -> None:
        self.engine = engine or tiny_engine()
        self.config = ServerConfig(device="cpu", **config)
        self.metrics = Metrics()
        extra = {} if stall_seconds is None else {"stall_seconds": stall_seconds}
        extra.update({} if on_finished is None else {"on_finished": on_finished})
        self.worker = Worker(load=lambda status: self.engine, warmup=lambda engine: None,
                             max_queue=self.config.max_queue, **extra)
        self.app = create_app(self.config, self.worker, self.metrics)
        if start:   # else the app's lifespan starts the worker
            self.worker.start()
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.worker.state != "ready":
            assert time.monotonic() < deadline, f"worker not ready: {self.worker.state} {self.worker.detail}"
            time.sleep(0.01)

    def client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://tiny",
                                 headers=headers, timeout=REQUEST_TIMEOUT_S)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request on a fresh event loop; AssertionError if it takes over REQUEST_TIMEOUT_S."""
        async def go() -> httpx.Response:
            async with self.client() as client:
                return await asyncio.wait_for(client.request(method, path, **kwargs), REQUEST_TIMEOUT_S)

        try:
            return asyncio.run(go())
        except asyncio.TimeoutError:
            raise AssertionError(f"{method} {path} hung for {REQUEST_TIMEOUT_S} s") from None

    def stop(self) -> None:
        self.worker.stop()
