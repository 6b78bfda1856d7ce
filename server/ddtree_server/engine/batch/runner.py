"""Step runner: the model I/O of the batch engine (a prompt chunk of one request, a decode round of many).

A decode round over requests R: drafts for the speculative ones (one batched drafter forward),
their trees (``trees.py``; DDTree: all at once on the device, one copy back; governed requests:
the policy's plan), ONE target forward over every request's rows (``forward.py``), each request's
choice (``Request.choose``), the walk and the commit (KV compaction / GDN fold; for all slots at
once: dense greedy rounds ``commit.py``, hybrid rounds ``hybrid_rounds.commit_pending``).
A round of one request in slot 0 (and every round of a target without a batched forward) runs
the per-request forward on the slot's cache, which on CUDA is the Triton-kernel + CUDA-graph path
(its graphs are bound to slot 0's storage; a lone request in another slot runs batched); a greedy
``ddtree`` round there on a graphed dense target runs on the device after the drafter, one CUDA
graph and one copy back (``solo_round.py``).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ddtree_server.engine import decode
from ddtree_server.engine.batch.commit import commit_greedy
from ddtree_server.engine.batch.draft import fold_skipped, propose_batch
from ddtree_server.engine.batch.forward import Block, Layout, dense_forward
from ddtree_server.engine.batch.forward_hybrid import hybrid_forward
from ddtree_server.engine.batch.draft_graphs import DraftGraphs
from ddtree_server.engine.batch.graph_pool import GraphPool
from ddtree_server.engine.batch.graphs import BatchGraphs
from ddtree_server.engine.batch.hybrid_rounds import commit_pending, round_rows
from ddtree_server.engine.batch.policy import SpecPolicy
from ddtree_server.engine.batch.paged_draft import draft_caches
from ddtree_server.engine.batch.paged_hybrid import paged_caches
from ddtree_server.engine.batch.paged_solo import PagedSoloRound
from ddtree_server.engine.batch.pools import SlotPool
from ddtree_server.engine.batch.prefill import prefill_one
from ddtree_server.engine.batch.profile import measure
from ddtree_server.engine.batch.request import Request
from ddtree_server.engine.batch.reserve import largest_round
from ddtree_server.engine.batch import settle
from ddtree_server.engine.batch.solo_round import SOLO_ENV, SoloRound
from ddtree_server.engine.batch.trees import RoundInfo, round_trees
from ddtree_server.models.dense.graphs import GraphedTarget
from ddtree_server.models.dense.target import TargetModel
from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.hybrid.gdn_batch import gdn_tensors
from ddtree_server.models.hybrid.model import HybridTarget
from ddtree_server.models.layers import kernels_usable
from ddtree_server.speculative.tree import DraftTree
from ddtree_server.speculative.walk_gpu import walk_all


# "0": batched rounds never take graphs; "1": always the padded layout (graph-replayed on CUDA, run
# eagerly elsewhere: the CPU tests of the padding); unset: on for targets on the kernel path
# (hybrids: plain rounds, and rounds of chains / trees with the chunk method: graphs.py)
GRAPHS_ENV = "DDTREE_BATCH_GRAPHS"


class StepRunner:
    """Slot pools of the target (and drafter) caches and the forwards over them."""

    def __init__(self, target, drafter, *, slots: int, max_len: int, device, poison: bool = False,
                 graphs: bool | None = None, policy: SpecPolicy | None = None, rows: int | None = None,
                 pages: int | None = None):
        """``rows``: rows of a hybrid target's round scratch (``chunk`` method; ``round_rows``).
        ``pages``: the target's (and a DFlash drafter's) K/V in this many pages (the paged layout,
        ``paged.py``, ``paged_draft.py``, ``paged_hybrid.py``; every round batched) instead of slots."""
        self.target, self.drafter, self.device, self.poison_freed = target, drafter, device, poison
        self.model = getattr(target, "model", target)
        self.kind = "hybrid" if isinstance(self.model, HybridTarget) else \
            "dense" if isinstance(self.model, TargetModel) else None
        self.paged, self.slots = pages is not None, slots
        if self.paged and self.kind is None:
            raise ValueError("the paged KV layout needs a batched target forward (Llama, Qwen3, Qwen3.5); "
                             "serve this target with --kv-layout slot")
        cuda = torch.device(device).type == "cuda"
        want = graphs if graphs is not None else {"0": False, "1": True}.get(os.environ.get(GRAPHS_ENV, "").strip())
        # CUDA graphs of batched rounds: targets on the kernel path (hybrids: plain rounds); the drafter on CUDA
        head_dim = self.model.config.head_dim if self.kind == "hybrid" else getattr(self.model, "head_dim", 0)
        graphs = self.kind is not None and (
            want if want is not None else cuda and kernels_usable(head_dim, self.model.embed_tokens.weight))
        # a hybrid's chunk-method verify scratch: ONE per round, shared by the slots' caches (their
        # per-request forwards use its first rows; a batched round's block its rows at its row offset)
        self.scratch = self.model.new_scratch(round_rows(rows, slots)) \
            if self.kind == "hybrid" and self.model.method == "chunk" else None
        make = (lambda: target.new_cache(max_len + 1, scratch=self.scratch)) if self.scratch is not None else \
            (lambda: target.new_cache(max_len + 1))
        # with graphs the pool's last slot is the scratch slot of padding blocks (engine/batch/graphs.py)
        self.caches = paged_caches(self.model, pages, slots, max_len + 1, device, check=poison, scratch=self.scratch,
                                   spare=drafter.config.block_size if drafter is not None else 0,
                                   pool_slots=slots + graphs) if self.paged else \
            SlotPool(make, slots + graphs, pooled=self.kind is not None)
        # rows a round may verify: per tree (a hybrid slot's scratch), all trees (the round scratch)
        self.rows = (self.caches[0].cap if self.kind == "hybrid" else None,
                     self.scratch.rows if self.scratch is not None else None)
        # one CUDA graph pool for the batched target rounds and the batched drafter (graph_pool.py)
        self.graph_pool = GraphPool(device)
        # the paged layout's padding blocks: a slot without pages (their rows go to the dummy page)
        self.graphs = BatchGraphs(self.model, *self._kv(), capture=cuda, gdn=self._gdn(), cap=self.rows[0],
                                  pool=self.graph_pool, scratch=slots if self.paged else None,
                                  tables=self.tables if self.paged else None) if graphs else None
        self.block_size = int(drafter.config.block_size) if drafter is not None else None
        self.dcaches = self.draft_graphs = None
        if drafter is not None:
            self.raw_drafter = getattr(drafter, "drafter", drafter)
            pooled = isinstance(self.raw_drafter, DFlashDrafter)
            dgraphs = pooled and (want if want is not None else cuda)   # + a scratch slot (draft_graphs.py)
            self.dcaches = draft_caches(drafter, self.raw_drafter, slots, slots + dgraphs, max_len + 1 + self.block_size,
                                        pooled, self.caches if self.paged else None, device)
            self.draft_graphs = DraftGraphs(self.raw_drafter, self.dcaches.pool("k"), self.dcaches.pool("v"),
                                            capture=cuda, pool=self.graph_pool,
                                            tables=getattr(self.dcaches, "tables", None)) if dgraphs else None
        self.batched = self.kind is not None
        # what the largest eager round needs stays free of graph captures (reserve.py; CUDA only)
        if cuda and (self.graphs is not None or self.draft_graphs is not None):
            self.graph_pool.reserve = largest_round(self)
        # batch 1's greedy DDTree round after the drafter on the device (dense, graphed: solo_round.py)
        solo = self.kind == "dense" and drafter is not None and os.environ.get(SOLO_ENV, "").strip() != "0"
        self.solo = SoloRound(target, capture=cuda and target.capture) if solo and isinstance(
            target, GraphedTarget) and not self.paged else None
        # on pages: a lone request's greedy DDTree round after the batched drafter (paged_solo.py)
        self.paged_solo = PagedSoloRound(self.model, self.caches, capture=cuda and graphs and kernels_usable(
            head_dim, self.model.embed_tokens.weight)) if solo and self.paged else None   # (eager SDPA: s-shaped)
        # pinned buffers for small copies: batch 1's verify inputs and path rows; the batched walk's / commit's indices
        self._inputs_buf, self._rows_buf, *self._bufs = [decode.Staging() for _ in range(4)] if cuda else [None] * 4
        # the speculation policy governs ddtree requests (policy.py); it needs the batched forward
        self.policy = policy if drafter is not None and self.batched else None
        if self.policy is not None and self.policy.profile is None:
            self.policy.profile = measure(self)
        self.last = RoundInfo()

    # ---- slots --------------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        self.caches[slot].reset()
        if self.dcaches is not None:
            self.dcaches[slot].crop(0)

    def free(self, slot: int) -> None:
        if self.paged:
            self.caches.release(slot, poison=self.poison_freed)
        elif self.poison_freed:
            self.caches.poison(slot)
        if self.poison_freed and self.dcaches is not None:
            self.dcaches.poison(slot)

    def tables(self, blocks: list[Block], scratch: bool = False) -> Tensor | None:
        """The blocks' device page tables (the paged layout), else None. ``scratch``: every row
        to the dummy page (the measured forwards of ``reserve.py`` / ``profile.py``: their values
        are never read)."""
        if not self.paged:
            return None
        if scratch:
            return torch.zeros((len(blocks), self.caches.width), dtype=torch.int32, device=self.device)
        return self.caches.table([b.slot for b in blocks], self.device)

    def _gdn(self) -> dict | None:
        """The pooled GDN tensors of a hybrid target by name, the round scratch's too (``forward_hybrid.hybrid_forward``)."""
        return gdn_tensors(self.caches, self.model.method, self.scratch) if self.kind == "hybrid" else None

    def _kv(self):
        return self.caches.pool("k"), self.caches.pool("v")

    def eager_forward(self, caches: list, lay: Layout) -> tuple[Tensor, Tensor | None]:
        """The batched target forward of ``lay`` without graphs (``caches``: its blocks' slot caches)."""
        k, v = self._kv()
        if self.kind == "dense":
            return dense_forward(self.model, k, v, lay)
        return hybrid_forward(self.model, caches, k, v, lay, self._gdn())

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, req: Request, n: int | None = None) -> list[int] | None:
        """The next ``n`` prompt tokens (None: the rest) in one forward on the request's slot, after
        the ``req.prefilled`` already there: positions continue, dense KV extends, a hybrid's GDN
        recurrent / conv states carry over (a causal ``last_only`` block is committed at once).
        Returns ``[first token]`` after the last chunk, else None (no logits are used before)."""
        return prefill_one(self, req, len(req.prefill_ids) - req.prefilled if n is None else n)

    # ---- decode round -------------------------------------------------------------------------
    def room(self, req: Request) -> int:
        """Draft nodes the request's next round may verify: its rows left (and ``Request.grant``)."""
        room = self.caches[req.slot].max_len - req.s - 1
        return room if req.grant is None else min(room, req.grant - 1)

    def round(self, reqs: list[Request], speculate: bool = True) -> list[list[int] | None]:
        """One round for every request: its accepted tokens (path + bonus), None when its cache is
        full. ``speculate`` False: nobody drafts (a plain round, the speculation gate's choice)."""
        live = [r for r in reqs if self.room(r) >= 0]
        if not live:
            return [None] * len(reqs)
        self.last = RoundInfo()
        drafting = [r for r in live if self._drafting(r)] if speculate else []   # before any forward
        if not self.batched or (len(live) == 1 and live[0].slot == 0 and not self.paged):   # slot 0's graphs
            got = {id(r): self._solo(r, drafting) for r in live}
        else:
            got = dict(zip(map(id, live), self._batched(live, drafting)))
        for r in live:
            r.round_nodes += self.last.nodes
        if len(drafting) < len(live):
            drafted = set(map(id, drafting))
            self._fold([r for r in live if id(r) not in drafted])
        return [got.get(id(r)) for r in reqs]

    def _fold(self, reqs: list[Request]) -> None:
        """Requests that skipped the drafter keep their context rows (``draft.fold_skipped``)."""
        if self.dcaches is not None and self.dcaches.pooled:
            self._sync()
            fold_skipped(self.raw_drafter, self.dcaches, reqs)

    def _sync(self) -> None:
        """The paged layout's device tables (the drafter's too) get the rows changed since the last use."""
        if self.paged:
            self.caches.device_tables(self.device)

    def governed(self, req: Request) -> bool:
        return self.policy is not None and req.governed

    def _drafting(self, req: Request) -> bool:
        """A speculative mode, not granted a plain round (no pages for its block), the policy's say."""
        return req.mode != "ar" and (req.grant is None or req.grant > 1) and (
            not self.governed(req) or self.policy.drafts(req))

    def _trees(self, reqs: list[Request], drafted: list[Request], logits: Tensor | None,
               chains: list | None = None, device: bool = True) -> list[DraftTree]:
        """Every request's tree of the round (``trees.round_trees``; counted in ``self.last``)."""
        return round_trees(reqs, drafted, logits, chains, self.room, self.policy, self.last, device, self.rows)

    def _solo(self, req: Request, drafting: list[Request]) -> list[int]:
        cache, s = self.caches[req.slot], req.s
        draft = None
        if any(r is req for r in drafting):
            draft = self.drafter.propose(self.dcaches[req.slot], req.ctx, req.bonus, s)
            req.ctx = None
            got = self.solo.run(cache, draft, req, min(req.budget, self.room(req))) \
                if self.solo is not None and not self.governed(req) else None
            if got is not None:   # None: not a greedy ddtree round, or its padded forward does not fit
                return settle.device_round(self, req, got)
            draft = draft[None]
        # the host round: one request's heap (cheaper than the device build's kernels launched eagerly)
        tree = self._trees([req], [req] if draft is not None else [], draft, device=False)[0]
        ids, pos, mask = decode.tree_inputs(tree, s, self.device, self._inputs_buf)
        logits, feats = self.target.forward(cache, ids, pos, tree_mask=mask)
        return settle.commit(self, req, tree, settle.choose_and_walk(req, tree, logits, None), feats, self._rows_buf)

    def _batched(self, reqs: list[Request], spec: list[Request]) -> list[list[int]]:
        logits = chains = None
        if spec:
            args = ([self.dcaches[r.slot] for r in spec], [r.slot for r in spec], [r.ctx for r in spec],
                    [r.bonus for r in spec], [r.s for r in spec])
            self._sync()
            if self.draft_graphs is not None:
                logits = self.draft_graphs.propose(*args)
            elif self.dcaches.pooled:
                logits = propose_batch(self.raw_drafter, self.dcaches.pool("k"), self.dcaches.pool("v"), *args,
                                       tables=getattr(self.dcaches, "tables", None))
            else:
                logits = torch.stack([self.drafter.propose(self.dcaches[r.slot], r.ctx, r.bonus, r.s) for r in spec])
            for r in spec:
                r.ctx = None   # consumed by the drafter
            if self.paged_solo is not None and len(reqs) == 1 and spec and not self.governed(reqs[0]):
                got = self.paged_solo.round(self, reqs[0], logits[0])
                if got is not None:
                    return [got]
            chains = logits.argmax(dim=-1).tolist() if any(r.mode == "dflash" for r in spec) else None
        trees = self._trees(reqs, spec, logits, chains)
        blocks = [Block(r.slot, r.s, t.tokens, t.depths, None if t.is_chain else t.ancestors())
                  for r, t in zip(reqs, trees)]
        caches = [self.caches[r.slot] for r in reqs]
        k, v = self._kv()
        shape = self.graphs.shape(blocks) if self.graphs is not None else None
        if shape is not None:   # padded layout, graph replay: each block's rows start at starts[i]
            logits, feats, starts = self.graphs.forward(blocks, shape, caches)
        else:
            lay = Layout(blocks, self.device, pages=self.tables(blocks))
            starts = lay.offsets[:-1]
            logits, feats = self.eager_forward(caches, lay)
        if self.kind == "dense":
            for c, blk in zip(caches, blocks):
                c.length = blk.s + len(blk.ids)
        plain = all(r.params.greedy and r.processor is None for r in reqs)
        paged = self.caches if self.paged else None
        if plain and self.kind == "dense" and any(t.size > 1 for t in trees):   # one walk + commit
            done = commit_greedy(k, v, caches, feats, reqs, trees, list(starts), logits.argmax(dim=-1), self._bufs, paged)
            return [settle.settle(self, r, t, *got) for r, t, got in zip(reqs, trees, done)]
        if plain and any(t.size > 1 for t in trees):   # a hybrid round: every tree walked on the device at once
            walks = walk_all(logits.argmax(dim=-1), trees, list(starts), self._bufs[0])
        else:
            choices = logits.argmax(dim=-1).tolist() if plain else None
            walks = [settle.choose_and_walk(r, t, logits[a:a + t.size], None if choices is None else choices[a:a + t.size])
                     for r, t, a in zip(reqs, trees, starts)]
        if self.scratch is not None:   # hybrid, chunk method (trees within the scratch: round_trees)
            ctxs = commit_pending(k, v, self._gdn(), caches, feats, [r.slot for r in reqs], [r.s for r in reqs],
                                  list(starts), [p for p, _ in walks], self._bufs[1], paged)   # every slot's keep at once
            return [settle.settle(self, r, t, p, b, ctx) for r, t, (p, b), ctx in zip(reqs, trees, walks, ctxs)]
        return [settle.commit(self, r, t, w, None if feats is None else feats[a:a + t.size])
                for r, t, w, a in zip(reqs, trees, walks, starts)]
