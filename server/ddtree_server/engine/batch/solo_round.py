"""The batch-1 DDTree round after the drafter, all on the device (greedy requests, dense targets).

One request in slot 0 of a dense target on the graphed path (``GraphedTarget``), mode ``ddtree``,
greedy, no logits processor: from the drafter's logits ``[L, vocab]`` on, the round's work stays on
the device until ONE device-to-host copy at its end (accepted count, path rows, path tokens, bonus):

1. ``log_softmax`` + top-K (K = min(width, vocab)) and ``build_trees_device`` (b = 1, width = the
   request's tree budget); the first ``cap = min(budget, room)`` nodes are live (device scalar);
2. the verify inputs straight into the target's static buffers of bucket N >= width + 1
   (``GraphedTarget.static_inputs``): ids, positions s + depth, the ``[N, N]`` ancestor mask (rows
   past the live nodes see only themselves, as the target's padding rows do);
3. the target's layer stack (``GraphedTarget.run_static``), argmax, ``walk_rows``;
4. the commit with fixed shapes: the tree's rows in path order (accepted rows first, then the rest)
   are copied to ``s .. s+N-1`` (rows past the path are dead: the host then sets the cache length
   to s + len(path)), and the same order gathers the feature rows of the drafter's next context.

On CUDA steps 1-4 are ONE CUDA graph per (width, target bucket) replayed every round, after two
small copies into its static inputs (the draft logits; root token, s and cap in one pinned copy).
Elsewhere the same code runs eagerly. Trees equal the host heap's up to exact ties
(speculative/tree_gpu.py); the walk follows the target's argmax, so the tokens are plain greedy
decoding's either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree_server.speculative.tree_gpu import ancestor_mask, build_trees_device, topk_logp
from ddtree_server.speculative.walk_gpu import walk_rows

log = logging.getLogger(__name__)
SOLO_ENV = "DDTREE_SOLO_ROUND"   # "0": lone requests keep the host / batched round (A/B measurements; paged_solo.py too)
HEAD = 4   # packed result: accepted count, live nodes, chain flag, bonus; then N path rows, N path tokens


@dataclass
class SoloResult:
    """One round: the accepted path (node rows, root first), the emitted tokens (accepted drafts,
    then the bonus), the bonus, draft nodes verified, whether the tree was a chain, and the path's
    feature rows (fresh storage)."""

    path: list[int]
    tokens: list[int]
    bonus: int
    nodes: int
    chain: bool
    ctx: Tensor | None

    @property
    def kind(self) -> str:
        """The tree's kind (``trees.KINDS``)."""
        return "plain" if self.nodes == 0 else "chain" if self.chain else "tree"


class _Round:
    """Static inputs / outputs of one (width, target bucket) and its graph."""

    def __init__(self, width: int, st, draft: Tensor, capture: bool):
        self.width, self.st = width, st
        self.draft = torch.zeros_like(draft) if capture else None   # [L, vocab] (the graph's input)
        self.scal = torch.zeros(3, dtype=torch.long, device=draft.device)   # root token, s, cap
        self.graph = None
        self.out: Tensor | None = None
        self.ctx: Tensor | None = None


class SoloRound:
    """The device round of a graphed dense target (``target``: GraphedTarget); ``capture``: CUDA
    graphs (else eager, e.g. on the CPU)."""

    def __init__(self, target, capture: bool):
        self.target, self.capture = target, capture
        self.enabled = True   # False after a capture error: the host round from then on
        self._rounds: dict[tuple, _Round] = {}
        self._ptr = None
        self._pool = None
        self.io = Transfers()

    def _get(self, cache, width: int, draft: Tensor) -> _Round | None:
        st = self.target.static_inputs(cache, width + 1)
        if st is None:
            return None
        if cache.k.data_ptr() != self._ptr:   # graphs captured another cache's addresses
            self._rounds.clear()
            self._pool = None   # their memory pool died with them: a new graph starts a new one
            self._ptr = cache.k.data_ptr()
        key = (width, id(st), tuple(draft.shape), draft.dtype)
        rd = self._rounds.get(key)
        if rd is None or rd.st is not st:
            with torch.inference_mode(False):   # normal tensors: updatable in and out of inference mode
                rd = _Round(width, st, draft, self.capture)
            self._rounds[key] = rd
        return rd

    def run(self, cache, draft: Tensor, req, cap: int) -> SoloResult | None:
        """One round after the drafter for ``req`` (its cache ``cache`` holds its s committed
        tokens; its bonus token is the root at position s): draft logits ``[L, vocab]``, width = its
        tree budget, ``cap`` live nodes (min(budget, room)). Returns None, with nothing done, where
        the device round does not apply (not a greedy ``ddtree`` request without a processor, cap
        < 1, or the target's padded forward of width + 1 rows does not fit): the host round's turn."""
        if not self.enabled or req.mode != "ddtree" or cap < 1 or not req.params.greedy or req.processor is not None:
            return None
        root, s, width = req.bonus, req.s, req.budget
        rd = self._get(cache, width, draft)
        if rd is None:
            return None
        self.io.scalars(rd.scal, (root, s, cap), self.capture)
        if self.capture:
            rd.draft.copy_(draft)
            if rd.graph is None:
                try:
                    self._capture(rd, cache)
                except RuntimeError as exc:   # the cache is as before (warm-up rows are spare rows)
                    log.warning("device round disabled (CUDA graph capture failed): %s", exc)
                    self.enabled = False
                    return None
            host = self.io.replay(rd.graph, rd.out)
        else:
            host = self._body(rd, cache, draft).tolist()
        result = unpack(host, rd.st.n, rd.ctx)
        cache.length = s + len(result.path)
        return result

    def _capture(self, rd: _Round, cache) -> None:
        # warm-up writes K/V (and their compaction) only into spare rows past the real capacity;
        # the real inputs are written back before the replay
        real = rd.scal.clone()
        rd.scal[1].fill_(cache.k.shape[2] - rd.st.n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(rd, cache, rd.draft)
        torch.cuda.current_stream().wait_stream(side)
        rd.scal.copy_(real)
        rd.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(rd.graph, pool=self._pool):
            self._body(rd, cache, rd.draft)
        self._pool = rd.graph.pool()

    def _body(self, rd: _Round, cache, draft: Tensor) -> Tensor:
        """Steps 1-4 of the module docstring with fixed shapes and no host synchronisation; sets
        ``rd.out`` (the packed result ``[HEAD + 2N]``) and ``rd.ctx`` (``[N, F]``: the path's
        feature rows first) and returns ``rd.out``."""
        st = rd.st
        n, depth_max = st.n, draft.shape[0]
        s = rd.scal[1]
        tree = device_tree(draft, rd.width, n, rd.scal[0:1], rd.scal[2])
        # verify inputs: rows past the live nodes see only themselves (each its own "parent")
        st.ids.copy_(tree.ids)
        st.pos.copy_(tree.dep + s)
        st.s.copy_(s)
        st.block.copy_(tree.mask(depth_max))
        logits, feats = self.target.run_static(st, cache)
        order, rd.out = walk_and_pack(logits, tree, depth_max)
        dst = torch.arange(n, device=draft.device) + s
        for kv in (cache.k, cache.v):
            kv.index_copy_(2, dst, kv.index_select(2, order + s))
        rd.ctx = None if feats is None else feats.index_select(0, order)
        return rd.out


class Transfers:
    """The host side of a device round on CUDA: its three input scalars in through a pinned buffer,
    its graph replayed and its packed result back through another (the round's one wait)."""

    def __init__(self):
        self._host = self._back = None

    def scalars(self, dst: Tensor, values: tuple[int, int, int], pinned: bool) -> None:
        if not pinned:
            dst.copy_(torch.tensor(values))
            return
        self._host = self._host if self._host is not None else torch.empty(3, dtype=torch.long, pin_memory=True)
        self._host.numpy()[:] = values   # free again: the last round ended with a wait
        dst.copy_(self._host, non_blocking=True)

    def replay(self, graph, out: Tensor) -> list[int]:
        graph.replay()
        if self._back is None or self._back.numel() < out.numel():
            self._back = torch.empty(out.numel(), dtype=torch.long, pin_memory=True)
        back = self._back[:out.numel()]
        back.copy_(out, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return back.tolist()


def unpack(host: list[int], n: int, ctx: Tensor | None) -> SoloResult:
    """The round's result from its packed form (``walk_and_pack``) of ``n`` rows and the rows'
    feature rows in path order (the path's rows copied out)."""
    k, nodes, chain, bonus = host[:HEAD]
    path, toks = host[HEAD:HEAD + k], host[HEAD + n:HEAD + n + k]
    return SoloResult(path, toks[1:] + [bonus], bonus, nodes, bool(chain), None if ctx is None else ctx[:k].clone())


@dataclass
class DeviceTree:
    """One request's tree on the device in ``n`` rows (root first, then the nodes, then padding):
    tokens, depths, parents (the root's -1), which rows are live (the root and the first ``cap``
    nodes), their count and whether the tree is a chain (``[1]`` long)."""

    tok: Tensor
    dep: Tensor
    par: Tensor
    live: Tensor
    nodes: Tensor
    chain: Tensor

    @property
    def ids(self) -> Tensor:
        """The verify forward's token ids (dead rows: token 0)."""
        return torch.where(self.live, self.tok, 0)

    def mask(self, depth_max: int) -> Tensor:
        """The ``[n, n]`` ancestor-or-self mask; a dead row sees only itself (its own "parent")."""
        rows = torch.arange(self.tok.shape[0], device=self.tok.device)
        return ancestor_mask(torch.where(self.live, self.par, rows), depth_max)


def device_tree(draft: Tensor, width: int, n: int, root: Tensor, cap: Tensor) -> DeviceTree:
    """Step 1: the best-first tree of ``width`` nodes from draft logits ``[L, vocab]`` (root ``[1]``,
    ``cap`` a 0-d tensor: the live nodes at most) in ``n >= width + 1`` rows, all on the device."""
    dev = draft.device
    vals, ids = topk_logp(draft, width)
    tokens, depths, parents, counts = build_trees_device(vals[None], ids[None], width)
    nodes = torch.minimum(counts[0], cap)
    rows = torch.arange(n, device=dev)
    live = rows <= nodes                                        # the root and the first cap nodes
    zero, pad = torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(n - 1 - width, dtype=torch.long, device=dev)
    chain = ((parents[0] == rows[:width]) | ~live[1:width + 1]).all()[None].long()
    return DeviceTree(torch.cat((root, tokens[0], pad)), torch.cat((zero, depths[0], pad)),
                      torch.cat((zero - 1, parents[0], pad)), live, nodes, chain)


def device_chain(draft: Tensor, n: int, root: Tensor, cap: Tensor) -> DeviceTree:
    """A DFlash round's chain on the device: the argmax of each of the ``L`` draft positions
    (``[L, vocab]``), the first ``cap`` of them live, in ``n >= L + 1`` rows."""
    dev, depth = draft.device, draft.shape[0]
    rows = torch.arange(n, device=dev)
    pad = torch.zeros(n - 1 - depth, dtype=torch.long, device=dev)
    nodes = cap.clamp(max=depth)   # (no host tensor: this runs inside a CUDA graph capture)
    return DeviceTree(torch.cat((root, draft.argmax(dim=-1), pad)), torch.where(rows <= depth, rows, 0),
                      rows - 1, rows <= nodes, nodes, torch.ones(1, dtype=torch.long, device=dev))


def walk_and_pack(logits: Tensor, tree: DeviceTree, depth_max: int) -> tuple[Tensor, Tensor]:
    """Step 3's walk: the target's argmax against the live rows (dead rows hang under the root with
    token -1, which no choice matches). Returns the rows in commit order (path rows first, in index
    order) and the packed result (accepted count, live nodes, chain flag, bonus; the N rows in that
    order; their tokens)."""
    acc, bonus = walk_rows(logits.argmax(dim=-1), torch.where(tree.live, tree.tok, -1),
                           torch.where(tree.live, tree.par, 0), depth_max)
    order = torch.sort(acc, descending=True, stable=True).indices
    out = torch.cat((acc.sum()[None], tree.nodes[None], tree.chain, bonus.max()[None], order, tree.tok.gather(0, order)))
    return order, out
