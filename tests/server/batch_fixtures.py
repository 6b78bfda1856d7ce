"""Helpers of the batch-engine tests: random request specs with arrivals and cancellations, a
driver of the batch engine by hand, the alone == batched == ``ar`` check, and the drafters (an
oracle TEST DOUBLE that knows every prompt's greedy continuation; a real DFlashDrafter with random
weights)."""

from __future__ import annotations

import random
import threading

import torch
from ddtree_server.engine.decode import Staging
from ddtree_server.engine.engine import Engine
from ddtree_server.engine.sampling import SamplingParams

from tests.server.tiny import EOS, VOCAB, ByteTokenizer, OracleDrafter

LAYERS, HIDDEN, MAX_LEN = [1, 2], 64, 192


class ManyOracle(OracleDrafter):
    """TEST DOUBLE: an OracleDrafter for several prompts; a slot's request is recognised by the
    prompt features of its first proposal (those of the reference prefill, to fp32 rounding: the
    prompts of several requests may be prefilled in one batched forward; a request preempted and
    recomputed brings its prompt's features first)."""

    def __init__(self, table, **kw):
        super().__init__(0, [], **kw)
        self.table = table  # [(prompt features, prompt_len, reference)]

    def propose(self, cache, ctx, bonus_token, start_pos):
        if cache.length == 0:   # a preempted request's first proposal again: prompt + its tokens (the longest match)
            cache.who = max(((n, ref) for f, n, ref in self.table
                             if n <= ctx.shape[0] and torch.allclose(f, ctx[:n], atol=1e-4)), key=lambda w: w[0])
        self.prompt_len, self.reference = cache.who
        return super().propose(cache, ctx, bonus_token, start_pos)


def prompt_features(target, ids):
    cache = target.new_cache(MAX_LEN + 1)
    _, feats = target.forward(cache, torch.tensor(ids), torch.arange(len(ids)), last_only=True)
    return feats.clone()


def random_specs(seed: int, count: int = 32):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "a", "mat", "1+2=", "zz"]
    out = []
    for i in range(count):
        prompt = list(" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))).encode())
        mode = rng.choice(["ar", "dflash", "ddtree", "ddtree"])
        sampled = rng.random() < 0.25
        out.append(dict(
            rid=f"r{i}", prompt=prompt, mode=mode, budget=rng.choice([None, 3, 8, 20]) if mode == "ddtree" else None,
            params=dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7,
                        stop=[rng.choice(["a", "e", "zz"])] if rng.random() < 0.3 else [],
                        temperature=0.9 if sampled else 0.0, seed=rng.randint(0, 99) if sampled else None),
            arrive=rng.randint(0, 40), cancel_after=rng.randint(1, 6) if rng.random() < 0.15 else None))
    return out


def run_alone(engine, spec, mode=None, stats=None):
    """(tokens, finish reason) of the spec sent alone; ``stats``: a dict that gets its last stats by rid."""
    toks, reason = [], None
    for ev in engine.generate(spec["prompt"], SamplingParams(**spec["params"]), mode=mode or spec["mode"],
                              tree_budget=spec["budget"]):
        toks += ev.token_ids
        reason = ev.finish_reason or reason
        if stats is not None and ev.stats is not None:
            stats[spec["rid"]] = ev.stats
    return toks, reason


def run_batched(engine, specs):
    """Drive the batch engine by hand: arrivals at their step, cancellations after some events."""
    batch, reqs, got, events = engine.batch, {}, {s["rid"]: [] for s in specs}, {}
    step = 0
    while len(reqs) < len(specs) or batch.busy:
        for s in specs:
            if s["arrive"] == step or (s["rid"] not in reqs and not batch.busy and s["arrive"] < step):
                req = engine.make_request(s["prompt"], SamplingParams(**s["params"]), mode=s["mode"],
                                          tree_budget=s["budget"], cancel=threading.Event(), rid=s["rid"])
                batch.add(req)
                reqs[s["rid"]] = (s, req)
        for req, ev in batch.step():
            got[req.rid] += ev.token_ids
            events[req.rid] = events.get(req.rid, 0) + 1
            s = reqs[req.rid][0]
            if s["cancel_after"] is not None and events[req.rid] >= s["cancel_after"]:
                req.cancel.set()
            if ev.finish_reason:
                events[req.rid] = ev.finish_reason
        step += 1
    return got, events


def run_together(engine, jobs, params) -> tuple[list[list[int]], list[int]]:
    """``jobs`` (prompt ids, mode) all added at once and stepped until done: each job's tokens and
    the batch size of every step (``params()``: a fresh SamplingParams per request)."""
    reqs = [engine.make_request(ids, params(), mode=m, rid=str(i)) for i, (ids, m) in enumerate(jobs)]
    for r in reqs:
        engine.batch.add(r)
    got, sizes = {r.rid: [] for r in reqs}, []
    while engine.batch.busy:
        for r, ev in engine.batch.step():
            got[r.rid] += ev.token_ids
        sizes.append(engine.batch.last.batch)
    return [got[str(i)] for i in range(len(jobs))], sizes


def check_alone_batched_ar(engine, specs, ar_engine, stats=None):
    """Batched output equals each spec alone, and plain decoding where deterministic; ``stats``: a
    dict that gets the alone runs' stats by rid."""
    got, finish = run_batched(engine, specs)
    assert engine.batch.max_running < len(specs)
    for s in specs:
        alone, reason = run_alone(engine, s, stats=stats)
        if finish[s["rid"]] == "cancelled":
            assert got[s["rid"]] == alone[: len(got[s["rid"]])], s
            continue
        assert got[s["rid"]] == alone, s
        assert finish[s["rid"]] == reason, s
        if s["params"]["temperature"] == 0.0 or s["params"]["seed"] is not None:
            assert run_alone(ar_engine, s, mode="ar")[0] == alone, s


def oracle_drafter(target, specs):
    ar = Engine(target, ByteTokenizer(), eos_token_ids=[EOS], max_model_len=MAX_LEN, max_running=1)
    table = []
    for s in specs:
        # the greedy continuation as far as the spec's drafts can look (its max_tokens + a block, and a
        # block to spare): the oracle proposes exactly the same rows as with the whole continuation
        n = min(MAX_LEN - len(s["prompt"]) - 1, s["params"]["max_tokens"] + 16)
        ref, _ = run_alone(ar, dict(s, params=dict(max_tokens=n, ignore_eos=True)), mode="ar")
        table.append((prompt_features(target, s["prompt"]), len(s["prompt"]), ref))
    return ManyOracle(table, vocab=VOCAB, hidden=HIDDEN, layer_ids=LAYERS, block_size=8), ar


def real_drafter(target, block=6, window=None):
    """The DFlash drafter with random weights on ``target`` (2 layers; ``window``: the first a
    sliding-window layer of that window, as the Qwen3.6 drafters' layouts)."""
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.model import DFlashDrafter

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
           "dflash_config": {"mask_token_id": 257, "target_layer_ids": LAYERS}, "num_hidden_layers": 2,
           "hidden_size": HIDDEN, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 10000.0}
    if window is not None:
        raw.update(layer_types=["sliding_attention", "full_attention"], sliding_window=window)
    torch.manual_seed(1)
    return DFlashDrafter(DrafterConfig.from_dict(raw), target.embed_tokens, target.lm_head).eval()


class Unpinned(Staging):
    """A staging buffer (engine/decode.py) without pinned memory: its copy path on the CPU."""

    def take(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)
