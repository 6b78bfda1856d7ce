"""Engine: owns the target, optional drafter, tokenizer and the batch engine that runs requests.

``generate`` is one request through the batch engine (``engine/batch/``): requests generated
concurrently (the API worker, several open generators) share its steps. Not thread-safe: the API
runs it on a single worker thread. Modes (docs/architecture.md):
``ar`` (target only), ``dflash`` (linear draft block), ``ddtree`` (draft tree). The default is
``ddtree`` when a drafter is loaded and the target can verify trees, else ``ar``.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Iterator, Sequence


from ddtree_server.engine.batch import BatchEngine, GenerationEvent, Request
from ddtree_server.engine.batch.gate import SpecGate
from ddtree_server.engine.batch.policy import POLICIES, Profile, SpecPolicy
from ddtree_server.engine import memory
from ddtree_server.engine.memory import CPU_MAX_RUNNING, CUDA_MAX_RUNNING, KV_MEMORY_FRACTION, slots_for  # noqa: F401
from ddtree_server.engine.sampling import SamplingParams
from ddtree_server.engine.processors import RequestProcessor
from ddtree_server.engine.stats import DecodeStats
from ddtree_server.engine.stopping import StopChecker
from ddtree_server.models import families
from ddtree_server.models.drafter.graphs import GraphedDrafter
from ddtree_server.models.dense.target import TargetModel
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.hybrid.model import HybridTarget

MODES = ("ar", "dflash", "ddtree")
CUDA_TREE_BUDGET = 16  # default DDTree budget on CUDA (nodes; docs/benchmarks/h200-2026-12-02-gate-http/)
CUDA_PREFILL_CHUNK = 512  # prompt tokens per engine step on CUDA (docs/architecture.md)
CPU_PREFILL_CHUNK = 128   # ... on the CPU (a 128-token forward of SmolLM2 takes ~0.1-0.3 s there)
KV_LAYOUTS = ("auto", "slot", "paged")
POISON_ENV = "DDTREE_POISON_FREED_SLOTS"  # debug: fill freed slots with NaN


class Engine:
    """Decoding engine over a TargetModel (or HFRunner) and an optional DFlash drafter.

    Args:
        target: TargetModel / HybridTarget / HFRunner (``new_cache``, ``forward``, ``capture_layers``);
            on CUDA wrapped in GraphedTarget / GraphedHybrid.
        tokenizer: HF tokenizer (with chat template).
        drafter: DFlashDrafter-like (``config.block_size``, ``config.target_layer_ids``,
            ``new_cache``, ``propose``) or None.
        model_id: served model name; max_model_len: context window in tokens (prompt + output).
        tree_mode_available: False for targets that cannot verify trees (hybrid fallback).
        default_mode: None -> ddtree with a drafter and tree mode, else ar.
        tree_budget: default DDTree node budget (None -> block_size - 1 on CPU, 16 on CUDA).
        eos_token_ids: stop tokens always added (unless ignore_eos).
        cuda_graphs: on CUDA, replay the target's forwards and the drafter's proposals from CUDA
            graphs (models/dense/graphs.py, models/drafter/graphs.py).
        max_running: requests decoded together (slots); None: CPU_MAX_RUNNING on the CPU, on CUDA
            as many slots as ``kv_memory_fraction`` of the free GPU memory holds (at most
            CUDA_MAX_RUNNING); 1 for targets without a batched forward (HFRunner).
        kv_memory_fraction: share of the free GPU memory (after loading) the slots may take when
            max_running is None (CUDA); default KV_MEMORY_FRACTION.
        prefill_chunk: prompt tokens per engine step over all prefilling requests (chunked
            prefill, interleaved with decode rounds); None: CUDA_PREFILL_CHUNK on CUDA,
            CPU_PREFILL_CHUNK on the CPU; 0: whole prompts in one step.
        poison_freed_slots: fill a freed slot's caches with NaN (debug; default from the
            DDTREE_POISON_FREED_SLOTS environment variable).
        spec_policy: ``auto``: the speculation policy (engine/batch/policy.py) chooses every
            ``ddtree`` request's tree round by round under one global node budget (its tree
            budget is a cap); ``fixed``: every request runs its mode and budget as given.
            ``fixed`` is the server's default too (config.py).
        profile: the policy's time profile (policy.Profile); None: measured at start-up.
        spec_gate: the speculation gate (engine/batch/gate.py): each round of speculative
            requests runs plain when plain rounds are measured faster at that batch size (a
            busy server, a poor drafter). The server's default is on (config.py); built
            directly, off (rounds then run every request's mode as given).
        round_rows: rows of a hybrid target's round verify scratch (``chunk`` method: one per
            engine; a round's trees are cut to fit it); None: ``hybrid_rounds.round_rows``.
        kv_layout: ``slot`` (every slot's K/V at max_model_len from start-up), ``paged`` (the
            target's K/V in pages of 16 rows, a hybrid's GDN states per slot; admission and
            look-ahead by pages, preemption by recompute; engine/batch/paged.py, paged_hybrid.py,
            admission.py) or ``auto`` (the
            default: ``memory.choose_layout``); ``self.kv_layout`` is the one taken.
        kv_pages: pages of the paged layout; None / 0: on the CPU as many as the slots hold at
            max_model_len, on CUDA what ``kv_memory_fraction`` of the free memory holds (a page: the
            target's and a DFlash drafter's K/V; ``memory.default_pages``).
    Raises:
        ValueError: an unknown/unavailable default mode or drafter/target mismatch.
    """

    def __init__(self, target, tokenizer, drafter=None, *, model_id: str = "model",
                 max_model_len: int | None = None, tree_mode_available: bool = True,
                 default_mode: str | None = None, tree_budget: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, cuda_graphs: bool = True,
                 max_running: int | None = None, poison_freed_slots: bool | None = None,
                 kv_memory_fraction: float | None = None, prefill_chunk: int | None = None,
                 spec_policy: str = "fixed", profile: Profile | None = None, spec_gate: bool = False,
                 round_rows: int | None = None, kv_layout: str = "auto", kv_pages: int | None = None):
        device = target.embed_tokens.weight.device
        graphed = families.graphed(target) if cuda_graphs and device.type == "cuda" else None
        if graphed is not None:  # a family of ours: its CUDA-graph wrapper (models/families.py)
            target = graphed
            if isinstance(drafter, DFlashDrafter):  # checks itself against eager on first use
                drafter = GraphedDrafter(drafter)
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.model_id = model_id
        cfg_len = getattr(target.config, "max_position_embeddings", None) or 4096
        self.max_model_len = int(min(max_model_len or cfg_len, cfg_len))
        self.tree_mode_available = bool(tree_mode_available)
        self.eos_token_ids = list(eos_token_ids if eos_token_ids is not None
                                  else [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.device = device
        self.block_size = int(drafter.config.block_size) if drafter is not None else None
        self.tree_budget = int(tree_budget) if tree_budget is not None else self._default_budget()
        if drafter is not None:
            if not self.tree_mode_available:
                raise ValueError("a drafter needs a target that can verify trees")
            target.capture_layers = list(drafter.config.target_layer_ids)
        self.default_mode = default_mode or ("ddtree" if self.spec_available else "ar")
        self._check_mode(self.default_mode)
        if max_running is not None and int(max_running) < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        fraction = KV_MEMORY_FRACTION if kv_memory_fraction is None else float(kv_memory_fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if prefill_chunk is not None and int(prefill_chunk) < 0:
            raise ValueError(f"prefill_chunk must be >= 0 tokens (0: whole prompts), got {prefill_chunk}")
        if prefill_chunk is None:
            prefill_chunk = CUDA_PREFILL_CHUNK if device.type == "cuda" else CPU_PREFILL_CHUNK
        self.round_rows = round_rows
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {kv_layout!r}; use one of {', '.join(KV_LAYOUTS)}")
        self.kv_layout, measured = memory.choose_layout(self, kv_layout, max_running, fraction)
        paged = self.kv_layout == "paged"
        if paged and not isinstance(getattr(target, "model", target), (TargetModel, HybridTarget)):
            raise ValueError("the paged KV layout needs a batched target forward (Llama, Qwen3, Qwen3.5); "
                             "use --kv-layout slot")
        slots = measured or memory.default_running(self, max_running, fraction, paged)
        pages = memory.default_pages(self, slots, fraction, kv_pages) if paged else None
        poison = bool(int(os.environ.get(POISON_ENV, "0") or 0)) if poison_freed_slots is None else poison_freed_slots
        if spec_policy not in POLICIES:
            raise ValueError(f"unknown spec policy {spec_policy!r}; use one of {', '.join(POLICIES)}")
        policy = SpecPolicy(profile) if spec_policy == "auto" and self.spec_available else None
        self.batch = BatchEngine(target, drafter, max_running=slots, max_len=self.max_model_len,
                                 device=device, poison=poison, prefill_chunk=int(prefill_chunk) or None,
                                 policy=policy, gate=SpecGate() if spec_gate and self.spec_available else None,
                                 round_rows=round_rows, pages=pages)
        self.spec_policy = "auto" if self.batch.runner.policy is not None else "fixed"
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self.messages: list[str] = []  # start-up lines (set by engine.factory.load_engine)

    def _default_budget(self) -> int | None:
        """block_size - 1 nodes on CPU (verify cost grows with the node count); CUDA_TREE_BUDGET on
        CUDA: the fastest budget measured at batch 1 was 16-32 nodes (a 64-node tree accepts
        more but its round costs more), and under load 16 nodes beat 64 (their rounds' rows
        grow with the batch)."""
        if self.block_size is None:
            return None
        return CUDA_TREE_BUDGET if self.device.type == "cuda" else self.block_size - 1

    @property
    def spec_available(self) -> bool:
        """True when dflash / ddtree can run (drafter loaded, tree-capable target)."""
        return self.drafter is not None and self.tree_mode_available

    def _check_mode(self, mode: str) -> str:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if mode != "ar" and not self.spec_available:
            why = ("the target cannot verify draft trees (hybrid / recurrent layers), so it is served "
                   "with plain decoding") if not self.tree_mode_available else "no drafter is loaded"
            raise ValueError(f"mode {mode} is unavailable: {why}")
        return mode

    @property
    def vocab_size(self) -> int:
        """Logits columns of the target (token ids a processor or grammar may refer to)."""
        return int(self.target.config.vocab_size)

    @property
    def grammars(self):
        """The ``constrained.compiler.GrammarCompiler`` for this tokenizer (built on first use;
        thread-safe): the API compiles ``response_format`` / tool grammars with it."""
        with self._grammars_lock:
            if self._grammars is None:
                from ddtree_server.constrained.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def encode(self, text: str, chat: bool = True) -> list[int]:
        """Prompt ids: the chat template with one user message (``chat``), else raw tokens."""
        if not chat:
            return list(self.tokenizer.encode(text))
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return [int(t) for t in out]

    def _slot_bytes(self, paged: bool = False) -> tuple[int, int]:
        """(bytes of one slot, bytes allocated once): ``memory.slot_bytes``."""
        return memory.slot_bytes(self, paged)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one request slot as allocated (``batch.slot_bytes``; /metrics)."""
        return self.batch.slot_bytes

    @property
    def max_concurrency(self) -> int:
        """Requests that run at the same time (the worker's cap): the batch engine's slots."""
        return self.batch.max_running

    def make_request(self, prompt_ids: list[int], params: SamplingParams, *, mode: str | None = None,
                     tree_budget: int | None = None, cancel: threading.Event | None = None,
                     rid: str = "", processor=None, spec_policy: str | None = None) -> Request:
        """A validated request for ``self.batch`` (see ``generate`` for the checks); ``spec_policy``
        (``auto`` / ``fixed``; None: the engine's) says whether the policy governs a ddtree request
        (only an engine built with ``spec_policy="auto"`` has one)."""
        params.validate()
        mode = self._check_mode(mode or self.default_mode)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len "
                             f"{self.max_model_len}")
        budget = 0
        if mode == "ddtree":
            budget = int(tree_budget if tree_budget is not None else self.tree_budget)
            if budget < 0:
                raise ValueError(f"tree_budget must be >= 0, got {budget}")
        elif mode == "dflash":
            budget = self.block_size - 1
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        checker = StopChecker(self.tokenizer, max_tokens=min(params.max_tokens, self.max_model_len - len(prompt_ids)),
                              stop=params.stop, stop_token_ids=stop_ids, prompt_ids=prompt_ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        if processor is None:   # grammar / penalties / logit_bias / logprobs of the request, if any
            proc = RequestProcessor(params, prompt_ids, self.vocab_size, self.device)
            processor = proc if proc.active or proc.wants_logprobs else None
        return Request(rid=rid, prompt_ids=prompt_ids, params=params, mode=mode, budget=budget,
                       checker=checker, seed=int(seed), cancel=cancel, processor=processor,
                       governed=mode == "ddtree" and self.spec_policy == "auto" and spec_policy != "fixed")

    def generate(self, prompt_ids: list[int], params: SamplingParams, *, mode: str | None = None,
                 tree_budget: int | None = None, cancel: threading.Event | None = None
                 ) -> Iterator[GenerationEvent]:
        """Stream a completion of ``prompt_ids``; the last event carries finish_reason and stats.

        max_tokens is clipped to the room left in ``max_model_len`` (finish "length").
        Raises ValueError (before the first event) for an empty or too long prompt, bad params,
        an unavailable mode or a negative tree budget. Steps the shared batch engine until this
        request has an event (other open requests advance in the same steps).
        """
        req = self.make_request(prompt_ids, params, mode=mode, tree_budget=tree_budget, cancel=cancel)
        self.batch.add(req)
        return self._events(req)

    def _events(self, req: Request) -> Iterator[GenerationEvent]:
        try:
            while True:
                while not req.events:
                    self.batch.step()
                ev = req.events.pop(0)
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.batch.abort(req)

    def generate_text(self, prompt: str | list[int], params: SamplingParams, *, chat: bool = True,
                      mode: str | None = None, tree_budget: int | None = None,
                      cancel: threading.Event | None = None) -> tuple[str, DecodeStats]:
        """Run a whole request; ``prompt`` is text (encoded with ``encode(chat=chat)``) or ids."""
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else prompt
        text, stats = "", None
        for ev in self.generate(ids, params, mode=mode, tree_budget=tree_budget, cancel=cancel):
            text += ev.text
            stats = ev.stats or stats
        return text, stats

