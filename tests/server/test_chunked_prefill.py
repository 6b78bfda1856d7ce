"""Chunked prefill: a prompt prefilled over several engine steps equals the whole-prompt prefill.

Tiny random dense (Qwen3) and hybrid (Qwen3.5: GDN recurrent + conv state carried across chunks)
targets, fp32 on the CPU. Per chunk size (1, 7, 16, the prompt length): the first token, the
last row's logits and the drafter's prompt features (to fp32 tolerance) and the generated tokens
over many rounds in every mode (ar / dflash / ddtree; the real DFlashDrafter with random weights)
equal those of the whole-prompt prefill, also for prompts at the model's maximum length. A long
prompt admitted while other requests decode leaves their tokens unchanged, and they get a decode
round in every step between its chunks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from tests.server.drafter_fixtures import shipped_drafter
from tests.server.hybrid_fixtures import tiny_hybrid
from tests.server.tiny import EOS, VOCAB, ByteTokenizer, tiny_target

LAYERS, HIDDEN, MAX_LEN = [1, 2], 64, 96
PROMPT = list(b"The quick brown fox jumps over the lazy dog; 1+2=3, 4+5=")


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def target(request):
    torch.set_num_threads(1)
    model = tiny_target() if request.param == "dense" else tiny_hybrid("3gdn+attn", seed=21)
    model.capture_layers = LAYERS
    return model


def _drafter(target):
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.model import DFlashDrafter

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 6,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 1,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    torch.manual_seed(1)
    return DFlashDrafter(DrafterConfig.from_dict(raw), target.embed_tokens, target.lm_head).eval()


def _engine(target, chunk, drafter=None, running=4):
    return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_model_len=MAX_LEN,
                  max_running=running, prefill_chunk=chunk, poison_freed_slots=True)


def _prefill(engine, prompt, mode="dflash"):
    """Prefill one request by engine steps; returns (request, first token, steps it took)."""
    req = engine.make_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), mode=mode)
    engine.batch.add(req)
    steps = 0
    while not req.events:
        engine.batch.step()
        steps += 1
    return req, req.events[0].token_ids, steps


def _logits(engine, req):
    """Logits of the next decode forward of ``req`` (its bonus at position s) on its slot."""
    runner = engine.batch.runner
    with torch.inference_mode():
        out, _ = runner.model.forward(runner.caches[req.slot], torch.tensor([req.bonus]), torch.tensor([req.s]))
    return out


@pytest.mark.parametrize("chunk", [1, 7, 16, len(PROMPT)])
def test_chunks_equal_whole_prompt_state_and_features(target, chunk):
    whole, chunked = _engine(target, 0, _drafter(target)), _engine(target, chunk, _drafter(target))
    ref, ref_tok, ref_steps = _prefill(whole, PROMPT)
    got, tok, steps = _prefill(chunked, PROMPT)
    assert ref_steps == 1 and steps == -(-len(PROMPT) // chunk)
    assert tok == ref_tok and got.s == ref.s == len(PROMPT) and got.bonus == ref.bonus
    assert got.ctx.shape == ref.ctx.shape == (len(PROMPT), HIDDEN * len(LAYERS)) and not got.ctx_parts
    torch.testing.assert_close(got.ctx, ref.ctx, rtol=1e-4, atol=1e-4)
    # the caches hold the same prompt: the next forward's logits agree (KV; GDN recurrent + conv)
    torch.testing.assert_close(_logits(chunked, got), _logits(whole, ref), rtol=1e-4, atol=1e-4)


def _generate(engine, prompt, mode, n=40, budget=None):
    toks, reason = [], None
    for ev in engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True), mode=mode, tree_budget=budget):
        toks += ev.token_ids
        reason = ev.finish_reason or reason
    return toks, reason


@pytest.mark.parametrize("chunk", [1, 7, 16, len(PROMPT)])
def test_generated_tokens_equal_in_every_mode(target, chunk):
    drafter = _drafter(target)
    whole, chunked = _engine(target, 0, drafter), _engine(target, chunk, drafter)
    ar = _generate(whole, PROMPT, "ar")
    for mode, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
        assert _generate(chunked, PROMPT, mode, budget=budget) == ar, mode


@pytest.mark.parametrize("chunk", [16, 100])
def test_prompt_at_the_maximum_length(target, chunk):
    """A prompt of the model's maximum length less one token (max_position_embeddings: 512 dense,
    1024 hybrid) leaves room for one token, chunked or not; a slightly shorter one decodes."""
    drafter = _drafter(target)

    def engine(c):
        return Engine(target, ByteTokenizer(), drafter, eos_token_ids=[EOS], max_running=2, prefill_chunk=c)

    whole, chunked = engine(0), engine(chunk)
    limit = target.config.max_position_embeddings
    assert whole.max_model_len == limit >= 512
    prompt = (PROMPT * (limit // len(PROMPT) + 1))[: limit - 1]
    for mode in ("ar", "ddtree"):
        ref = _generate(whole, prompt, mode)
        assert ref[1] == "length" and len(ref[0]) == 1
        assert _generate(chunked, prompt, mode) == ref, mode
    near = prompt[: limit - 9]
    assert _generate(chunked, near, "ddtree") == _generate(whole, near, "ar")


def test_long_prompt_interleaves_with_running_requests(target):
    """Two requests decode; a long prompt arrives: it takes ceil(n / chunk) steps, the running
    requests get a round in each of them and their tokens are those they get alone."""
    chunk, drafter = 8, _drafter(target)
    engine = _engine(target, chunk, drafter)
    short = [(list(b"alpha beta"), "ddtree"), (list(b"the cat sat"), "ar")]
    alone = [_generate(engine, p, m, n=50) for p, m in short]
    batch, got = engine.batch, {}
    reqs = []
    for i, (p, m) in enumerate(short):
        reqs.append(engine.make_request(p, SamplingParams(max_tokens=50, ignore_eos=True), mode=m, rid=f"s{i}"))
        batch.add(reqs[-1])
    for _ in range(3):   # both decoding
        for r, ev in batch.step():
            got.setdefault(r.rid, []).extend(ev.token_ids)
    long = engine.make_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), mode="dflash",
                               cancel=threading.Event(), rid="long")
    batch.add(long)
    trace = []
    while batch.busy:
        evs = batch.step()
        for r, ev in evs:
            got.setdefault(r.rid, []).extend(ev.token_ids)
        trace.append((batch.last.kind, batch.last.prefill_tokens, {r.rid for r, ev in evs if ev.token_ids}))
    chunks = -(-len(PROMPT) // chunk)
    prefill = [t for t in trace if t[1]]
    assert [t[1] for t in prefill] == [chunk] * (chunks - 1) + [len(PROMPT) - chunk * (chunks - 1)]
    assert all(t[0] == "mixed" and {"s0", "s1"} <= t[2] for t in prefill)   # a round in every chunk's step
    assert "long" in prefill[-1][2] and not any("long" in t[2] for t in prefill[:-1])
    assert [got["s0"], got["s1"]] == [a[0] for a in alone]
    assert got["long"] == _generate(engine, PROMPT, "ar", n=8)[0]


def test_chunk_budget_is_shared_oldest_first(target):
    """Several prompts admitted together share one budget per step, the oldest finished first."""
    engine = _engine(target, 16)
    prompts = [PROMPT[:20], PROMPT[:9], PROMPT[:30]]
    reqs = [engine.make_request(p, SamplingParams(max_tokens=3, ignore_eos=True), mode="ar", rid=str(i))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.batch.add(r)
    plans = []
    while any(r.prefilling for r in reqs):
        before = [r.prefilled for r in reqs]
        engine.batch.step()
        plans.append([(r.rid, r.prefilled - b) for r, b in zip(reqs, before) if r.prefilled > b])
        assert engine.batch.last.prefill_tokens == sum(n for _, n in plans[-1]) <= 16
    assert plans == [[("0", 16)], [("0", 4), ("1", 9), ("2", 3)], [("2", 16)], [("2", 11)]]
    for r, p in zip(reqs, prompts):
        while not r.finished:
            engine.batch.step()
        toks = [t for ev in r.events for t in ev.token_ids]
        assert toks == _generate(_engine(target, 0), p, "ar", n=3)[0]


@pytest.mark.parametrize("chunk", [1, 7])
def test_graphed_static_path_chunks_equal_whole(target, chunk):
    """Slot 0 prefills through the CUDA-graph wrapper on CUDA; its static path (no capture)
    takes chunks of a bucket's size (dense) or the single-row commit (hybrid) here."""
    from ddtree_server.models.dense.graphs import GraphedTarget
    from ddtree_server.models.hybrid.graphs import GraphedHybrid
    from ddtree_server.models.hybrid.model import HybridTarget

    graphed = (GraphedHybrid if isinstance(target, HybridTarget) else GraphedTarget)(target, capture=False)
    drafter = _drafter(target)
    ar = _generate(_engine(target, 0, drafter), PROMPT, "ar")
    for mode in ("ar", "ddtree"):
        assert _generate(_engine(graphed, chunk, drafter), PROMPT, mode, budget=8) == ar, mode


@pytest.mark.slow
def test_smollm2_shipped_drafter_chunked_equals_whole(smollm2):
    """The real SmolLM2 and its shipped drafter: a chunked prompt gives the whole-prompt tokens
    and the same rounds (the drafter saw the same prompt context)."""
    drafter = shipped_drafter(smollm2)
    try:
        runs = []
        for chunk in (0, 13):
            eng = Engine(smollm2.model, smollm2.tokenizer, drafter, max_model_len=256, max_running=2,
                         eos_token_ids=smollm2.eos_token_ids, prefill_chunk=chunk)
            ids = eng.encode("Write a Python function that returns the n-th Fibonacci number iteratively.")
            evs = list(eng.generate(ids, SamplingParams(max_tokens=32, ignore_eos=True), mode="ddtree",
                                    tree_budget=15))
            runs.append(([t for ev in evs for t in ev.token_ids], evs[-1].stats.decode_rounds))
        assert len(ids) > 13 * 2 and runs[0] == runs[1]
        assert runs[0][1] < 32 / 1.5   # the drafter is useful: it saw the prompt's context
    finally:
        smollm2.model.capture_layers = []


_KERNEL_CHILD = """
import json, os, torch
from tests.server.interp_fast import install
install()
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.models.layers import kernels_usable
from tests.server.tiny import EOS, ByteTokenizer, tiny_target
from tests.server.hybrid_fixtures import tiny_hybrid
torch.set_num_threads(1)
prompt, out = list(b"The quick brown fox jumps over the lazy dog"), {}
# three layers (hybrid: two GDN + attention): a chunk read wrong by the attention of layers 0-1 changes the
# K/V of the layers above it and the tokens (two dense layers do not, within 6 tokens)
for name, t in (("dense", tiny_target(layers=3)), ("hybrid", tiny_hybrid("2gdn+attn", seed=21))):
    runs = []
    for chunk in (0, 7):   # the whole prompt on the SDPA path (DDTREE_KERNELS is read at every forward)
        os.environ["DDTREE_KERNELS"] = "1" if chunk else "0"
        e = Engine(t, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=96, max_running=2, prefill_chunk=chunk)
        runs.append([x for ev in e.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True), mode="ar")
                     for x in ev.token_ids])
    out[name] = {"kernels": kernels_usable(16, t.embed_tokens.weight), "equal": runs[0] == runs[1]}
print(json.dumps(out))
"""


@pytest.mark.kernels
def test_chunks_on_the_kernel_path_equal_whole():
    """The Triton kernels (interpreter): a chunk's attention reads the slot's earlier rows through
    the split-K kernel with the chunk's start (dense FastBlock, hybrid chain). The reference, the
    whole prompt, runs on the SDPA / torch path: the interpreter's cost is the chunked run's alone,
    and the kernel path's tokens are those of the SDPA path (test_kernels_engine)."""
    pytest.importorskip("triton")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", DDTREE_KERNELS="1",
               PYTHONPATH=os.pathsep.join([str(repo / "server"), str(repo)]))
    run = subprocess.run([sys.executable, "-c", _KERNEL_CHILD], capture_output=True, text=True, env=env,
                         timeout=900, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    assert doc == {k: {"kernels": True, "equal": True} for k in ("dense", "hybrid")}


def _prefilled(engine, prompts):
    """Run the prompts together (dflash, 12 tokens): per request its first token, drafter prompt
    features and slot K/V right after its prefill, and all its tokens."""
    reqs = [engine.make_request(p, SamplingParams(max_tokens=12, ignore_eos=True), mode="dflash", rid=str(i))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.batch.add(r)
    snap = {}
    while engine.batch.busy:
        engine.batch.step()
        for r, p in zip(reqs, prompts):
            if r.events and r.rid not in snap:
                cache = engine.batch.runner.caches[r.slot]
                snap[r.rid] = (r.events[0].token_ids[:1], r.ctx.clone(), cache.k[:, :, : len(p)].clone())
    return [(snap[r.rid], [t for ev in r.events for t in ev.token_ids]) for r in reqs]


def test_chunks_of_several_requests_in_one_forward_equal_their_own_forwards(monkeypatch):
    """Dense: the chunks of several requests in a step run as one batched forward (prefill.py);
    each request's first token, drafter prompt features and slot K/V equal its prefill alone (its
    chunks through the slot's own forward), and its tokens equal alone."""
    from ddtree_server.engine.batch import engine as batch_engine

    torch.set_num_threads(1)
    model = tiny_target()
    model.capture_layers = LAYERS
    calls = []
    real = batch_engine.prefill_many
    monkeypatch.setattr(batch_engine, "prefill_many", lambda runner, chunks: calls.append(len(chunks)) or real(runner, chunks))
    prompts = [PROMPT[:20], PROMPT[:9], PROMPT[:30], PROMPT[:3], PROMPT[:14]]
    together = _prefilled(_engine(model, 16, _drafter(model), running=5), prompts)
    assert calls and max(calls) >= 3
    n_batched = len(calls)
    for p, ((first, ctx, kv), toks) in zip(prompts, together):
        (first1, ctx1, kv1), toks1 = _prefilled(_engine(model, 16, _drafter(model), running=5), [p])[0]
        assert first == first1 and toks == toks1
        assert torch.allclose(ctx, ctx1, atol=1e-5) and torch.allclose(kv, kv1, atol=1e-5)
    assert len(calls) == n_batched   # alone: one chunk per step, never the batched forward
