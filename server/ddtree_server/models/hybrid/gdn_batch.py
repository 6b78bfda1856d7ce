"""The GDN token mixer over the rows of several requests at once (the batch engine's rounds).

Each request's GDN state lives in its slot of the pooled cache tensors (``engine/batch/pools.py``):
``state [slots, L, Hv, Dk, Dv]`` fp32, ``conv [slots, L, K-1, C]`` (L: the GDN layers); the
``chunk`` method's verify scratch ``kk / uu / GG [L, rows, Hv, *]``, ``inputs [L, rows, C]`` and
``win [rows, K]`` is ONE per round (the slots' caches share it), a pending block's rows at its row
offset in the round. A round's
blocks fall in three groups, built once per forward (``gdn_groups.RowGroups``) and run per GDN
layer with a request axis instead of a loop over the requests:

* ``step``: blocks of one row committed at once (plain decoding): one conv step over each slot's
  committed conv rows, the conv state shifted in place, one delta-rule step on each slot's state
  (``delta.steps``; on CUDA the fused kernels with a request axis, ``kernels/gdn_batch.py``);
* ``chunk``: pending blocks of n <= cap rows, chains (DFlash) and trees (DDTree) alike: block rows
  written to the scratch's ``inputs``, each row's conv window (``tree.py``) gathered from its
  slot's committed rows and its block's inputs, then the tree-masked chunked rule over the blocks padded to the longest
  (``delta.tree_chunks``: a padding row has zero inputs and no ancestors); k, u, G go to the round's
  scratch rows of the block for the commit (``HybridCache.keep`` per slot, or ``engine/batch/hybrid_rounds.py:
  commit_pending`` for all slots, folds the accepted path as alone);
* the rest (the ``node`` method) keep the per-request mixer (``GatedDeltaNet.mix``).

A request's rows are computed from its own slot and block only, so they equal its rows alone up
to the float order of batched matmuls (torch); the kernels' programs are per (request, head), so
their rows are bitwise those of the same request alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.kernels import gdn_batch as kernels
from ddtree_server.kernels import gdn_batch_tree as tree_kernels
from ddtree_server.kernels.gdn_norm import gated_norm
from ddtree_server.models.hybrid import delta, gdn_fast
from ddtree_server.models.hybrid.gdn_groups import Chunks

_checked: set[tuple] = set()   # self-checked kernel cases (see ``step``)
# the pooled cache tensors the batched mixer reads and writes, per GDN tree method (the chunk
# method's verify scratch is the round's: ``gdn_tensors``)
POOLS = {"chunk": ("state", "conv"), "node": ("state", "conv", "win")}


def gdn_tensors(pool, method: str, scratch=None) -> dict:
    """The tensors the batched mixer reads and writes, by name: the slot pool's (``POOLS``) and, for
    the ``chunk`` method, the round's shared verify scratch ``win / kk / uu / GG``."""
    out = {n: pool.pool(n) for n in POOLS[method]}
    if method == "chunk":
        out.update(scratch.tensors())
    return out


def _conv(mixer, windows: Tensor) -> Tensor:
    """Conv + SiLU of rows whose K-row windows ``[m, K, C]`` are gathered (model dtype out)."""
    w = mixer.conv1d.weight[:, 0, :].float()
    return torch.nn.functional.silu(torch.einsum("mkc,ck->mc", windows.float(), w)).to(windows.dtype)


def _split(mixer, proj: Tensor):
    return proj.split((mixer.conv_dim, mixer.value_dim, mixer.hv, mixer.hv), dim=-1)


def step_torch(mixer, proj: Tensor, conv: Tensor, state: Tensor, slots: Tensor) -> Tensor:
    """One committed row per request (pure torch): proj ``[b, P]`` (request i's row, slot
    ``slots[i]``); conv ``[slots, K-1 + cap, C]`` and state ``[slots, Hv, Dk, Dv]`` of this layer
    (updated in place). Returns the gated, normed output ``[b, value_dim]``."""
    b, k1 = proj.shape[0], mixer.kernel - 1
    qkv, z, bb, a = _split(mixer, proj)
    windows = torch.cat((conv[slots, :k1], qkv[:, None]), dim=1)            # [b, K, C]
    conv[slots, :k1] = windows[:, 1:]
    q, k, v, g, beta = mixer.heads(_conv(mixer, windows).float(), bb, a)
    o, new = delta.steps(q, k, v, g, beta, state[slots])
    state[slots] = new
    return mixer.norm(o, z.view(b, mixer.hv, mixer.dv)).reshape(b, mixer.value_dim)


def chunk_torch(mixer, proj: Tensor, conv: Tensor, state: Tensor, kk: Tensor, uu: Tensor, GG: Tensor,
                inputs: Tensor, ch: Chunks) -> Tensor:
    """Pending blocks (pure torch): proj ``[m, P]`` the blocks' rows (``ch.rows`` order); this
    layer's pooled conv, state and the round's scratch ``kk / uu / GG [rows, Hv, *]``, ``inputs
    [rows, C]`` (block j's rows from ``ch.base[j]``). States and conv are read, the scratch
    written. Returns ``[m, value_dim]``."""
    m, k1 = proj.shape[0], mixer.kernel - 1
    qkv, z, bb, a = _split(mixer, proj)
    dst = scratch_rows(ch)
    inputs[dst] = qkv
    src = ch.base.long()[ch.req][:, None] + ch.win - k1                     # window rows K-1+j: block row j
    windows = torch.where((ch.win < k1)[..., None], conv[ch.slot_of_row[:, None], ch.win.clamp(max=k1 - 1)],
                          inputs[src.clamp(min=0)])                          # [m, K, C]
    q, k, v, g, beta = mixer.heads(_conv(mixer, windows).float(), bb, a)
    b, r = ch.anc.shape[0], ch.r

    def pad(x: Tensor) -> Tensor:
        out = x.new_zeros((b, r, *x.shape[1:]))
        out[ch.req, ch.local] = x
        return out

    o, u, G = delta.tree_chunks(pad(q), pad(k), pad(v), pad(g), pad(beta), state[ch.slots], ch.anc)
    u, G = u[ch.req, ch.local], G[ch.req, ch.local]
    kk[dst] = k
    uu[dst] = u
    GG[dst] = G
    return mixer.norm(o[ch.req, ch.local], z.view(m, mixer.hv, mixer.dv)).reshape(m, mixer.value_dim)


def scratch_rows(ch: Chunks) -> Tensor:
    """Long ``[m]``: each row's row in the round's verify scratch (its block's base + its row)."""
    return ch.base.long()[ch.req] + ch.local


def step_fused(mixer, proj: Tensor, conv: Tensor, state: Tensor, slots: Tensor) -> Tensor:
    """``step_torch`` on the kernels with a request axis (``kernels/gdn_batch.py``; no checks)."""
    dims = (mixer.hk, mixer.hv, mixer.dk, mixer.dv)
    q, k, v, g, beta = kernels.step_pre(proj, conv, slots, mixer.conv1d.weight[:, 0, :], mixer.A_log,
                                        mixer.dt_bias, dims)
    o = kernels.step_states(q, k, v, g, beta, state, slots)
    return gated_norm(o, proj[:, mixer.conv_dim:mixer.conv_dim + mixer.value_dim], mixer.norm.weight, mixer.norm.eps)


def step(mixer, proj: Tensor, gdn: dict, li: int, slots: Tensor) -> Tensor:
    """One committed row per request on GDN layer ``li`` of the pools ``gdn`` (by name: state,
    conv): the kernels where the GDN kernels are on (the first call of each shape self-checked on
    its first request against ``step_torch`` as ``gdn_fast`` does, outside CUDA-graph capture; a
    mismatch turns the GDN kernels off), else torch."""
    conv, state = gdn["conv"][:, li], gdn["state"][:, li]
    if not gdn_fast.kernels_on(proj.device):
        return step_torch(mixer, proj, conv, state, slots)
    key = ("batch-step", proj.dtype, str(proj.device), mixer.hk, mixer.hv, mixer.dk, mixer.dv, mixer.kernel)
    if key in _checked:
        return step_fused(mixer, proj, conv, state, slots)
    if gdn_fast.capturing(proj.device):
        return step_torch(mixer, proj, conv, state, slots)
    if _check_step(mixer, proj[:1], conv, state, slots[:1], key):
        return step_fused(mixer, proj, conv, state, slots)
    return step_torch(mixer, proj, conv, state, slots)


def _check_step(mixer, proj: Tensor, conv: Tensor, state: Tensor, slots: Tensor, key: tuple) -> bool:
    """Self-check of the step kernels on one request (its rows do not depend on the others, and
    the padding rows of a captured round share the scratch slot)."""
    touched = [(conv[:, :mixer.kernel - 1], slots), (state, slots)]
    return _self_check(lambda: step_torch(mixer, proj, conv, state, slots),
                       lambda: step_fused(mixer, proj, conv, state, slots), touched, key, "step", proj.dtype)


def _self_check(torch_run, fused_run, touched: list, key: tuple, what: str, dtype) -> bool:
    """Run the torch reference and the kernels from the same ``touched`` parts ``(tensor, index)``
    (restored after each), compare the outputs and the touched parts after each; True (and ``key``
    checked) within the tolerance of ``dtype`` (the projections'), else False and the GDN kernels off."""
    before = [t[i].clone() for t, i in touched]
    want = torch_run()
    ref = [t[i].clone() for t, i in touched]
    for (t, i), b in zip(touched, before):
        t[i] = b
    try:
        got = fused_run()
        errs = [gdn_fast.rel_err(got, want)] + [gdn_fast.rel_err(t[i], r) for (t, i), r in zip(touched, ref)]
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here: torch path
        errs = [f"{type(exc).__name__}: {exc}"]
    for (t, i), b in zip(touched, before):
        t[i] = b
    tol = gdn_fast.TOLERANCE.get(dtype, 2e-2)
    if all(isinstance(e, float) and e <= tol for e in errs):
        _checked.add(key)
        return True
    gdn_fast.disable(f"GDN kernels disabled: batched {what} self-check relative errors {errs} > {tol}")
    return False


def chunk_fused(mixer, proj: Tensor, conv: Tensor, state: Tensor, kk: Tensor, uu: Tensor, GG: Tensor,
                inputs: Tensor, ch: Chunks) -> Tensor:
    """``chunk_torch`` on the kernels with a request axis (``kernels/gdn_batch_tree.py``; no checks)."""
    dims = (mixer.hk, mixer.hv, mixer.dk, mixer.dv)
    q, k, v, beta = tree_kernels.pre_rows(proj, conv, GG, inputs, ch, mixer.conv1d.weight[:, 0, :], mixer.A_log,
                                          mixer.dt_bias, dims)
    o = tree_kernels.tree_rules(q, k, v, beta, state, kk, uu, GG, ch)
    return gated_norm(o, proj[:, mixer.conv_dim:mixer.conv_dim + mixer.value_dim], mixer.norm.weight, mixer.norm.eps)


def chunk(mixer, proj: Tensor, gdn: dict, li: int, ch: Chunks) -> Tensor:
    """Pending blocks on GDN layer ``li`` of the pools ``gdn`` (state, conv; the round's scratch
    kk, uu, GG, inputs): the
    kernels where the GDN kernels are on (the first group of each longest-block size self-checked
    on its first block against ``chunk_torch``, outside CUDA-graph capture; a mismatch turns the
    GDN kernels off), else ``chunk_torch``."""
    views = [gdn[n][:, li] for n in ("conv", "state")] + [gdn[n][li] for n in ("kk", "uu", "GG", "inputs")]
    if not gdn_fast.kernels_on(proj.device):
        return chunk_torch(mixer, proj, *views, ch)
    key = ("batch-chunk", ch.r, proj.dtype, str(proj.device), mixer.hk, mixer.hv, mixer.dk, mixer.dv, mixer.kernel)
    if key not in _checked and (gdn_fast.capturing(proj.device) or not _check_chunk(mixer, proj, views, ch, key)):
        return chunk_torch(mixer, proj, *views, ch)
    return chunk_fused(mixer, proj, *views, ch)


def _check_chunk(mixer, proj: Tensor, views: list, ch: Chunks, key: tuple) -> bool:
    """Self-check of the chunk kernels on the group's first block alone (its rows depend on its own
    slot only, and the padding blocks of a padded round share the scratch slot, so only a lone
    block compares): its scratch rows."""
    n = int(ch.qo[1])
    one = Chunks(ch.rows, ch.req[:n], ch.local[:n], ch.slot_of_row[:n], ch.slots[:1], ch.qo[:2], ch.win[:n],
                 ch.anc[:1], ch.r, ch.base[:1])
    rows = scratch_rows(one)
    touched = [(t, rows) for t in views[2:]]
    return _self_check(lambda: chunk_torch(mixer, proj[:n], *views, one),
                       lambda: chunk_fused(mixer, proj[:n], *views, one), touched, key, "chunk", proj.dtype)
