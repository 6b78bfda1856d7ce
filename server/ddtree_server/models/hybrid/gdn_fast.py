"""The fused-kernel path of the GDN token mixer and of the chunk commit (kernels/gdn_*.py).

Per GDN layer after the input projection (cuBLAS), instead of ~60 small torch kernels:
``gdn_pre`` (conv + SiLU, l2 norms, beta, path-cumsum gates; block rows written to the conv
buffer), then the rule (``step_rule`` for a committed decode step, updating the state in place;
``tree_rule`` for a pending ``chunk`` block, keeping k, u, G for the commit), then ``gated_norm``.
``fold`` commits an accepted path for all GDN layers in one launch. Prefills, chains longer than
the verify scratch and the ``node`` method stay on the pure-torch path (``GatedDeltaNet.mix``).

When: ``kernels.runtime.enabled`` (CUDA with Triton unless ``DDTREE_KERNELS=0``). Safety: the
first call of each (mode, rows, shape, dtype, device) is a self-check outside CUDA-graph capture:
the torch path and the kernels both run on the real inputs (and, for trees, first on a synthetic
tree of depth up to 16 with the same rows) and their outputs and kept state are compared (relative
L2 error within ``TOLERANCE`` of the dtype). On a mismatch or an exception the torch result is
kept, a warning is logged and the kernels are off for the rest of the process, so a kernel bug on
a GPU can never change the tokens (``GraphedHybrid`` then drops the graphs it captured with
them). During capture an unchecked case takes the torch path.
"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import torch
from torch import Tensor

from ddtree_server.kernels import gdn_tree, runtime
from ddtree_server.kernels.gdn_norm import gated_norm
from ddtree_server.kernels.gdn_pre import gdn_pre
from ddtree_server.kernels.gdn_state import fold_path, step_rule
from ddtree_server.models.hybrid import delta
from ddtree_server.models.hybrid.tree import tree_meta

log = logging.getLogger(__name__)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
_checked: set[tuple] = set()
_failed: list[str] = []  # non-empty: kernels off for this process (the reason)


def kernels_on(device: torch.device) -> bool:
    """Whether the GDN kernels run on ``device`` (on, and no self-check failed in this process)."""
    return not _failed and runtime.enabled(device)


def disable(reason: str) -> None:
    """Turn the GDN kernels off for the rest of the process (a failed self-check elsewhere)."""
    log.warning(reason)
    _failed.append(reason)


def usable(proj: Tensor, cache, ctx) -> bool:
    """Whether this forward of ``proj.shape[0]`` rows takes the kernel path."""
    if _failed or not runtime.enabled(proj.device):
        return False
    n = proj.shape[0]
    if ctx.mode == "commit":
        return n == 1
    return ctx.mode == "chunk" and n <= cache.cap


def capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def fused(mixer, proj: Tensor, cache, li: int, ctx) -> Tensor:
    """The mixer after the projection on kernels (no checks); same contract as ``mix``."""
    meta = ctx.meta
    dims = (mixer.hk, mixer.hv, mixer.dk, mixer.dv)
    commit = ctx.mode == "commit"
    G = torch.empty((1, mixer.hv), dtype=torch.float32, device=proj.device) if commit else cache.GG[li]
    q, k, v, beta = gdn_pre(proj, cache.conv[li], meta.win, meta.anc, mixer.conv1d.weight[:, 0, :],
                            mixer.A_log, mixer.dt_bias, dims, G, store_rows=not commit, commit=commit,
                            rows=cache.inputs[li])
    if commit:
        o = step_rule(q, k, v, G, beta, cache.state[li])
    else:
        o = gdn_tree.tree_rule(q, k, v, G, beta, cache.state[li], meta.anc, cache.kk[li], cache.uu[li])
    z = proj[:, mixer.conv_dim:mixer.conv_dim + mixer.value_dim]
    return gated_norm(o, z, mixer.norm.weight, mixer.norm.eps)


def mix(mixer, proj: Tensor, cache, li: int, ctx) -> Tensor:
    """``GatedDeltaNet.mix`` on kernels, self-checked on the first call of its kind."""
    key = (ctx.mode, proj.shape[0], proj.dtype, str(proj.device), mixer.hk, mixer.hv, mixer.dk, mixer.dv,
           mixer.kernel)
    if key in _checked:
        return fused(mixer, proj, cache, li, ctx)
    if capturing(proj.device):
        return mixer.mix(proj, cache, li, ctx)
    if ctx.mode == "chunk":
        anc = synthetic_tree(proj.shape[0]).to(proj.device)
        fake = SimpleNamespace(meta=tree_meta(anc, proj.shape[0], mixer.kernel, proj.device), mode="chunk")
        _check(mixer, proj, cache, li, fake, key, "synthetic tree")
        if _failed:
            return mixer.mix(proj, cache, li, ctx)
    out = _check(mixer, proj, cache, li, ctx, key, "first call")
    if not _failed:
        _checked.add(key)
    return out


def _touched(cache, li: int, n: int, mode: str) -> list[Tensor]:
    """Views of what a mixer call writes besides its output."""
    k1 = cache.kernel - 1
    if mode == "commit":
        return [cache.state[li], cache.conv[li, :k1]]
    return [cache.kk[li, :n], cache.uu[li, :n], cache.GG[li, :n]]


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / (b.norm() + 1e-30)).item()


def _check(mixer, proj: Tensor, cache, li: int, ctx, key: tuple, what: str) -> Tensor:
    n = proj.shape[0]
    views = _touched(cache, li, n, ctx.mode)
    before = [t.clone() for t in views]
    want = mixer.mix(proj, cache, li, ctx)
    ref = [t.clone() for t in views]
    for t, b in zip(views, before):
        t.copy_(b)
    try:
        got = fused(mixer, proj, cache, li, ctx)
        errs = [rel_err(got, want)] + [rel_err(t, r) for t, r in zip(views, ref)]
    except Exception as exc:  # a kernel that does not compile or run here: torch path
        got, errs = None, [f"{type(exc).__name__}: {exc}"]
    tol = TOLERANCE.get(proj.dtype, 2e-2)
    if got is not None and all(e <= tol for e in errs):
        return got
    reason = f"GDN kernels disabled: self-check ({what}, {key[:2]}) relative errors {errs} > {tol}"
    log.warning(reason)
    _failed.append(reason)
    for t, r in zip(views, ref):
        t.copy_(r)
    return want


def synthetic_tree(n: int, max_depth: int = 16, seed: int = 0) -> Tensor:
    """Ancestor-or-self mask ``[n, n]`` (bool) of a fixed random tree: branches and chains."""
    rng = random.Random(seed + n)
    depth, anc = [0], torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n):
        cands = [j for j in range(i) if depth[j] < max_depth]
        p = cands[-1] if rng.random() < 0.5 else rng.choice(cands)
        depth.append(depth[p] + 1)
        anc[i] = anc[p]
        anc[i, i] = True
    return anc


def fold_usable(cache) -> bool:
    """Whether ``HybridCache`` commits a chunk path with the fold kernel."""
    return not _failed and runtime.enabled(cache.state.device)


def fold(cache, idx: Tensor) -> None:
    """Commit the accepted path ``idx`` (long ``[m]`` on the device) of every GDN layer into
    ``cache.state`` in place (reference ``delta.fold``; self-checked on the first call)."""
    key = ("fold", cache.state.dtype, str(cache.state.device), tuple(cache.state.shape[1:]))
    if key in _checked:
        fold_path(cache.state, cache.kk, cache.uu, cache.GG, idx)
        return
    want = delta.fold(cache.state, cache.kk.index_select(1, idx), cache.uu.index_select(1, idx),
                      cache.GG.index_select(1, idx))
    try:
        fold_path(cache.state, cache.kk, cache.uu, cache.GG, idx)
        err = rel_err(cache.state, want)
    except Exception as exc:  # noqa: BLE001 - any kernel failure means: torch path
        err = f"{type(exc).__name__}: {exc}"
    if isinstance(err, float) and err <= TOLERANCE[torch.float32]:
        _checked.add(key)
        return
    reason = f"GDN kernels disabled: fold self-check relative error {err}"
    log.warning(reason)
    _failed.append(reason)
    cache.state.copy_(want)
