"""The shipped default drafter (ddtree_server/assets/drafter): loader path, size, and exactness.

The drafter was trained on the GPU with `ddtree-server train-drafter` (scripts/gpu_train_drafter.sh,
see docs/benchmarks/drafter/). Here, on the CPU in fp32 with the real SmolLM2 target, it must load
through the same loader the server uses, be the server's default, and give DDTree output equal to
plain decoding while accepting more than one token per target forward.
"""

from __future__ import annotations

import pytest

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models import default
from tests.server.drafter_fixtures import shipped_drafter

pytestmark = pytest.mark.slow

QUESTIONS = [  # MT-Bench 81 and two questions in its style (not training data: ShareGPT only)
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
    "experiences and must-see attractions.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]
N_NEW = 32   # several rounds per question at either budget (asserted)


def test_shipped_drafter_files_and_size():
    folder = default.default_drafter_dir()
    assert default.default_drafter_available(), folder
    size = (folder / "model.safetensors").stat().st_size
    assert size <= 24_000_000, f"shipped drafter is {size} bytes (limit 24 MB)"


@pytest.fixture(scope="module")
def drafter(smollm2):
    d = shipped_drafter(smollm2)
    yield d
    smollm2.model.capture_layers = []


def test_shipped_drafter_config(drafter):
    c = drafter.config
    assert c.block_size == 16 and list(c.target_layer_ids) == [1, 10, 19, 27] and c.mask_token_id == 16


@pytest.fixture(scope="module")
def engine(smollm2, drafter):
    return Engine(smollm2.model, smollm2.tokenizer, drafter, max_model_len=512,
                  eos_token_ids=smollm2.eos_token_ids)


@pytest.fixture(scope="module")
def plain(engine):
    """Each question's prompt ids and its plain (``ar``) continuation, decoded once for every budget."""
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    out = []
    for q in QUESTIONS:
        ids = engine.encode(q, chat=True)
        out.append((ids, [t for ev in engine.generate(ids, params, mode="ar") for t in ev.token_ids]))
    return out


@pytest.mark.parametrize("budget", [15, 64])
def test_shipped_drafter_ddtree_equals_ar_and_accepts(engine, plain, budget):
    eng = engine
    assert eng.default_mode == "ddtree"
    taus = []
    for ids, ar in plain:
        params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
        assert len(ar) == N_NEW
        evs = list(eng.generate(ids, params, mode="ddtree", tree_budget=budget))
        assert [t for ev in evs for t in ev.token_ids] == ar
        assert evs[-1].stats.decode_rounds >= 6, evs[-1].stats   # state carried over several rounds
        taus.append(evs[-1].stats.mean_acceptance_length)
    # a trained drafter on the target's own style of answers: well above one token per forward
    assert sum(taus) / len(taus) > 1.5, taus
