"""engine/progress.py: a Beacon on the target's layers records each layer's start, through the
CUDA-graph wrapper too, so the worker can tell a long prefill (layers keep starting) from a round
that hangs (tests/server/test_api_longinput.py runs the real server with it)."""

from __future__ import annotations

import time

import torch

from ddtree_server.engine.progress import Beacon
from ddtree_server.models.dense.graphs import GraphedTarget
from tests.server.tiny import tiny_target


def test_beacon_sees_every_layer_of_a_wrapped_target_start():
    torch.set_num_threads(1)
    target = GraphedTarget(tiny_target(layers=3), capture=False)
    watched = Beacon()
    assert watched.watch(target) == 3 and Beacon().watch(None) == 0 and watched.last() is None
    cache = target.new_cache(64)
    before = time.monotonic()
    with torch.inference_mode():
        target.forward(cache, torch.arange(20), torch.arange(20), last_only=True)
    assert watched.last() is not None and watched.last() >= before
    first = watched.last()
    with torch.inference_mode():
        target.forward(cache, torch.tensor([5]), torch.tensor([20]))
    assert watched.last() > first   # every forward's layers beat again
