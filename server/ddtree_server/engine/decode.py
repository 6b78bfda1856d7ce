"""The three decode loops: ``ar``, ``dflash`` and ``ddtree`` (batch 1).

Each loop is a generator over one request. Its first item is ``[t0]``, the token chosen from the
prefill logits; every further item is the list of tokens one target forward ("round") produced:
1 for ``ar``, ``len(path)`` (accepted drafts + bonus) for the speculative loops. The caller
(Engine) applies the stop rules and closes the generator when done; a loop returns by itself only
when the KV cache is full.

Speculative round (docs/ddtree.md §2.1), state: target cache of length s, bonus b at position s,
ctx = captured target features of the tokens the drafter has not seen yet:
1. draft logits ``[bs-1, vocab]`` = drafter.propose(draft_cache, ctx, b, s)
2. tree: ``ddtree`` = best-first tree (speculative/tree.py) from one log_softmax + top-K and one
   device-to-host copy; ``dflash`` = the chain of draft argmaxes
3. verify: one target forward over [b, nodes] at positions s + depth with the ancestor mask
   (no mask for chains)
4. walk (speculative/walk.py) over the target's per-node choices; compact the KV cache to the path;
   ctx = features of the path; s += len(path); b = bonus

A request with logits processing (grammar, penalties, logit_bias) or logprobs passes a
``RequestProcessor`` (engine/processors.py): the verified logits go through
``proc.process(logits, parents, tokens)`` before the choice (each node conditioned on its own
path; ``ar`` is a one-node tree) and every round ends with ``proc.commit(emitted, rows)``.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ddtree_server.engine.processors import RequestProcessor
from ddtree_server.engine.sampling import TokenChooser
from ddtree_server.speculative.tree import DraftTree, build_ddtree, chain_tree, root_only
from ddtree_server.speculative.tree_gpu import topk_logp
from ddtree_server.speculative.walk import accepted_tokens, walk

TreeBuilder = Callable[[Tensor, int, int], DraftTree]  # (draft_logits [L, V], root token, budget)


def _prefill(target, cache, prompt_ids: Sequence[int], device) -> tuple[Tensor, Tensor | None]:
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    pos = torch.arange(len(prompt_ids), device=device)
    return target.forward(cache, ids, pos, last_only=True)


_ROOT = [-1]   # parents of a one-node tree


def _choose(chooser: TokenChooser, proc: RequestProcessor | None, logits: Tensor,
            parents: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], Tensor]:
    """The target's choice per node and the (processed) rows it was made from."""
    if proc is not None and proc.active:
        logits = proc.process(logits, parents, tokens)
    return chooser.choose(logits), logits


def _commit(proc: RequestProcessor | None, tokens: list[int], rows: Tensor, path: list[int] | None = None) -> None:
    """Tell the processor what the round emitted (with the rows that chose them for logprobs)."""
    if proc is None:
        return
    if proc.wants_logprobs:
        rows = rows if path is None else rows.index_select(0, torch.tensor(path, device=rows.device))
        proc.commit(tokens, rows)
    else:
        proc.commit(tokens)


def ar_loop(target, cache, prompt_ids: Sequence[int], chooser: TokenChooser,
            device: torch.device | str, proc: RequestProcessor | None = None) -> Iterator[list[int]]:
    """Plain autoregressive decoding with the KV cache: one token per target forward."""
    logits, _ = _prefill(target, cache, prompt_ids, device)
    choices, rows = _choose(chooser, proc, logits, _ROOT, [prompt_ids[-1]])
    token = choices[0]
    _commit(proc, [token], rows)
    yield [token]
    ids = torch.empty(1, dtype=torch.long, device=device)
    pos = torch.empty(1, dtype=torch.long, device=device)
    while cache.length + 1 <= cache.max_len:
        ids.fill_(token)
        pos.fill_(cache.length)
        logits, _ = target.forward(cache, ids, pos)
        choices, rows = _choose(chooser, proc, logits, _ROOT, [token])
        token = choices[0]
        _commit(proc, [token], rows)
        yield [token]


def ddtree_builder(draft_logits: Tensor, root: int, budget: int) -> DraftTree:
    """Best-first DDTree from draft logits ``[L, vocab]``: log_softmax (fp32, raw logits), top-K
    with K = min(budget, vocab), one packed device-to-host copy, then ``build_ddtree``."""
    if budget <= 0:
        return root_only(root)
    logp, ids = topk_tables(draft_logits, budget)
    return build_ddtree(root, logp, ids, budget)


def topk_tables(draft_logits: Tensor, k: int) -> tuple:
    """``(logp, ids)`` host arrays ``[..., L, K]`` of the per-position top-K (K = min(k, vocab))
    of ``log_softmax`` (fp32, raw logits; ``tree_gpu.topk_logp``): one packed device-to-host copy."""
    vals, ids = topk_logp(draft_logits, k)   # in passes of bounded memory on a device
    # ids < 2**24 are exact in fp32: one tensor, one copy
    packed = torch.stack((vals, ids.to(torch.float32))).cpu().numpy()
    return packed[0], packed[1].astype("int64")


def dflash_builder(draft_logits: Tensor, root: int, budget: int) -> DraftTree:
    """DFlash's linear block: the argmax chain of all ``L`` draft rows (``budget`` caps it)."""
    tokens = draft_logits.argmax(dim=-1).tolist()
    return chain_tree(root, tokens[: max(budget, 0)])


class Staging:
    """A pinned host buffer for one kind of small host-to-device copy of a request's rounds, sent
    with ``non_blocking=True`` so the host does not wait for it. Reused round after round: safe
    because each round's copy is followed by a synchronisation (the target's choices come back to
    the host, ``TokenChooser.choose``) before the buffer is written again."""

    def __init__(self):
        self.buf: Tensor | None = None

    def take(self, nbytes: int) -> Tensor:
        """A pinned uint8 tensor of ``nbytes`` (the buffer grows by doubling)."""
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.empty(max(nbytes, 2 * (0 if self.buf is None else self.buf.numel()), 4096),
                                   dtype=torch.uint8, pin_memory=True)
        return self.buf[:nbytes]

    def send(self, host: np.ndarray, device) -> Tensor:
        """An int64 host array on ``device`` (same shape), copied through the buffer without
        waiting for the device."""
        flat = np.ascontiguousarray(host, dtype=np.int64).reshape(-1)
        buf = self.take(flat.nbytes)
        buf.numpy()[:] = flat.view(np.uint8)
        return buf.to(device, non_blocking=True).view(torch.int64).reshape(host.shape)


def tree_inputs(tree: DraftTree, start: int, device, staging: Staging | None = None
                ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Verify inputs of a tree whose root sits at position ``start``: ids ``[n]``, positions
    ``[n]`` (start + depth) and the bool ancestor mask ``[n, n]`` (None for a chain), sent to the
    device in ONE host-to-device copy of one byte buffer (int64 ids and positions, then one byte
    per mask entry), not three; asynchronous from ``staging`` (pinned) when given."""
    n = tree.size
    nbytes = 16 * n + (0 if tree.is_chain else n * n)
    host = staging.take(nbytes) if staging is not None else torch.empty(nbytes, dtype=torch.uint8)
    buf = host.numpy()
    idpos = buf[:16 * n].view(np.int64)
    idpos[:n] = tree.tokens
    idpos[n:] = tree.depths
    idpos[n:] += start
    if not tree.is_chain:
        buf[16 * n:] = tree.ancestors().reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=staging is not None)
    idpos = dev[:16 * n].view(torch.int64)
    return idpos[:n], idpos[n:], None if tree.is_chain else dev[16 * n:].view(n, n).view(torch.bool)


def path_rows(path: list[int], device, staging: Staging | None) -> Tensor:
    """The accepted path's node indices as a long tensor on the device (asynchronous via staging)."""
    if staging is None:
        return torch.tensor(path, dtype=torch.long).to(device)
    host = staging.take(8 * len(path))
    host.numpy().view(np.int64)[:] = path
    return host.to(device, non_blocking=True).view(torch.int64)


def spec_loop(target, drafter, cache, draft_cache, prompt_ids: Sequence[int], chooser: TokenChooser,
              device: torch.device | str, build: TreeBuilder, budget: int,
              proc: RequestProcessor | None = None) -> Iterator[list[int]]:
    """Speculative decoding with a drafter and a tree builder (see module docstring).

    ``target.capture_layers`` must equal ``drafter.config.target_layer_ids``. Raises ValueError
    if they differ.
    """
    if list(target.capture_layers) != list(drafter.config.target_layer_ids):
        raise ValueError("target.capture_layers must equal the drafter's target_layer_ids")
    logits, ctx = _prefill(target, cache, prompt_ids, device)
    choices, rows = _choose(chooser, proc, logits, _ROOT, [prompt_ids[-1]])
    bonus = choices[0]
    _commit(proc, [bonus], rows)
    yield [bonus]
    s = len(prompt_ids)
    cuda = torch.device(device).type == "cuda"
    inputs_buf, rows_buf = (Staging(), Staging()) if cuda else (None, None)
    while True:
        room = cache.max_len - s - 1
        if room < 0:
            return
        draft_logits = drafter.propose(draft_cache, ctx, bonus, s)
        tree = build(draft_logits, bonus, min(budget, room))
        ids, pos, mask = tree_inputs(tree, s, device, inputs_buf)
        logits, feats = target.forward(cache, ids, pos, tree_mask=mask)
        choices, scored = _choose(chooser, proc, logits, tree.parents, tree.tokens)
        path, new_bonus = walk(tree, choices)
        k = len(path)
        if path == list(range(k)):
            cache.keep(s, path)
            ctx = feats[:k]
        else:
            rows = path_rows(path, feats.device, rows_buf)
            cache.keep(s, path, rows)
            ctx = feats.index_select(0, rows)
        out = accepted_tokens(tree, path, new_bonus)
        _commit(proc, out, scored, path)
        s += k
        bonus = new_bonus
        yield out
