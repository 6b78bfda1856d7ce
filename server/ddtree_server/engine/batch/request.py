"""Per-request state of the batch engine (host bookkeeping only; tensors live in the slot pools)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ddtree_server.engine.batch import rng
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.engine.stats import DecodeStats
from ddtree_server.engine.stopping import StopChecker


@dataclass
class GenerationEvent:
    """One streamed step: tokens accepted this round (after stop trimming) and their text."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: DecodeStats | None
    logprobs: list | None = None   # one TokenLogprob per token of token_ids when the request asked


@dataclass(eq=False)  # identity: the scheduler finds requests in its lists by identity
class Request:
    """One generation: prompt, decoding choice, stop rules, and where it stands.

    ``s``: committed target length (prompt + accepted tokens, the bonus excluded); ``bonus``: the
    verified token at position s, not yet in the cache; ``ctx``: target features of the tokens
    the drafter has not seen. ``prefilled``: prompt tokens in the slot's cache so far (chunked
    prefill; the request decodes once it is the whole prompt); ``ctx_parts``: the prompt
    chunks' features until the last chunk joins them into ``ctx``. ``resume``: the rows a preempted
    request recomputes (prompt + its tokens but the bonus; None otherwise), ``grant``: the rows its
    next round may write (the paged layout's look-ahead; None: no bound). ``processor``: an optional per-request logits processor
    (``active``, ``process(logits, parents, tokens)``, ``commit(tokens)``); while active, the
    request's choices go through it (``choose``).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    budget: int                       # nodes after the root: 0 (ar), block-1 (dflash), tree budget
    checker: StopChecker
    seed: int
    cancel: threading.Event | None = None
    processor: Any = None
    slot: int | None = None
    s: int = 0
    bonus: int = 0
    ctx: Tensor | None = None
    events: list[GenerationEvent] = field(default_factory=list)
    finished: bool = False
    rounds: int = 0
    produced: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    t_decode: float = 0.0
    scored: Tensor | None = None      # the last choice's (processed) rows, until accept
    spec: Any = None                  # the speculation policy's state of a governed request (policy.py)
    governed: bool = False            # decoded under the speculation policy (--spec-policy auto)
    nodes: int = 0                    # draft nodes verified over its rounds
    round_nodes: int = 0              # draft nodes of the whole batch over its rounds (sum of N)
    kinds: dict = field(default_factory=lambda: {"plain": 0, "chain": 0, "tree": 0})   # rounds per tree kind
    prefilled: int = 0
    ctx_parts: list[Tensor] = field(default_factory=list)
    resume: list[int] | None = None
    grant: int | None = None
    preemptions: int = 0

    @property
    def prefill_ids(self) -> list[int]:
        """The rows to prefill: the prompt, or a preempted request's recompute."""
        return self.prompt_ids if self.resume is None else self.resume

    @property
    def prefilling(self) -> bool:
        """True until the whole prompt is in the slot's cache (the first token follows it)."""
        return self.prefilled < len(self.prefill_ids)

    def preempt(self) -> None:
        """Back to the queue by recompute: the rows in the cache (prompt + tokens but the bonus)
        are prefilled again on re-admission; the bonus and every emitted token stay (a request
        still prefilling starts its prefill again)."""
        self.preemptions += 1
        if self.prefilling:
            self.prefilled, self.ctx_parts = 0, []
            return
        done = self.checker.token_ids
        if len(self.prompt_ids) + len(done) - 1 != self.s:
            raise RuntimeError(f"request {self.rid}: {self.s} rows, but {len(self.prompt_ids)} prompt tokens "
                               f"and {len(done)} emitted")
        self.resume = [*self.prompt_ids, *done[:-1]]
        self.prefilled, self.s, self.ctx, self.ctx_parts, self.grant = 0, 0, None, [], None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def choose(self, logits: Tensor, parents: list[int], tokens: list[int], positions: list[int]) -> list[int]:
        """The target's choice per row of ``logits [n, vocab]`` (rows = tree nodes whose parents and
        tokens are given; row i chooses the token at ``positions[i]``): the one place where a
        request's processor acts on its rows (the processed rows are kept for ``accept``)."""
        if self.processor is not None and getattr(self.processor, "active", False):
            logits = self.processor.process(logits, parents, tokens)
        self.scored = logits
        return rng.choose(logits, self.params, self.seed, positions)

    def accept(self, tokens: list[int], path: list[int] | None = None) -> None:
        """The round's accepted tokens (path + bonus; ``path``: their rows, None = all rows): the
        processor advances its state and records logprobs from the rows that chose them."""
        proc, rows = self.processor, self.scored
        self.scored = None
        if proc is None:
            return
        if getattr(proc, "wants_logprobs", False) and rows is not None:
            if path is not None:
                rows = rows.index_select(0, torch.tensor(path, device=rows.device))
            proc.commit(tokens, rows)
        else:
            proc.commit(tokens)

    def take_logprobs(self, count: int, final: bool) -> list | None:
        """Logprobs of the tokens emitted since the last call (``count`` after stop trimming)."""
        if self.processor is None or not getattr(self.processor, "wants_logprobs", False):
            return None
        got = self.processor.take_logprobs() or []
        return got[:count] if got or not final else []

    def stats(self, block_size: int | None, end: float) -> DecodeStats:
        decode_s = end - self.t_decode if self.t_decode else 0.0
        return DecodeStats(
            mode=self.mode, tree_budget=self.budget if self.mode == "ddtree" else None,
            block_size=block_size if self.mode != "ar" else None,
            decode_rounds=self.rounds, generated_tokens=len(self.checker.token_ids),
            mean_acceptance_length=(self.produced / self.rounds) if self.rounds else None,
            prefill_seconds=self.prefill_s, decode_seconds=decode_s,
            tokens_per_second=(self.produced / decode_s) if self.rounds and decode_s > 0 else None,
            decode_tokens=self.produced, spec_policy="auto" if self.governed else "fixed",
            mean_tree_nodes=(self.nodes / self.rounds) if self.rounds else None,
            mean_round_nodes=(self.round_nodes / self.rounds) if self.rounds else None,
            plain_rounds=self.kinds["plain"], chain_rounds=self.kinds["chain"], tree_rounds=self.kinds["tree"])
