"""Module fixtures of the batch-engine tests: ``dense`` and ``hybrid``, tiny random targets (one
torch thread). Loaded with ``pytest_plugins = ["tests.server.tiny_fixtures"]``; each module gets
its own (module scope: tests set ``capture_layers`` on them)."""

from __future__ import annotations

import pytest
import torch

from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import tiny_target


@pytest.fixture(scope="module")
def dense():
    torch.set_num_threads(1)
    return tiny_target()


@pytest.fixture(scope="module")
def hybrid():
    torch.set_num_threads(1)
    return tiny_hybrid("3gdn+attn", seed=21)
