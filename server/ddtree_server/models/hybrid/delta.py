"""The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh, arXiv 2412.06464), in fp32,
for sequences (chunked prefill), single steps and draft TREES. Pure torch; ``steps`` and
``tree_chunks`` run several requests' blocks at once (the batch engine).

Per value head, state S is ``[Kd, Vd]``; per token t (q, k l2-normalised, q scaled by Kd^-0.5):
``S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t``
(the recurrence of transformers' ``torch_recurrent_gated_delta_rule``).

Unrolled from a state S0 over a root path, with G_t = sum of g over the path up to t:
``S_t = exp(G_t) S0 + sum_{s <= t} exp(G_t - G_s) k_s u_s^T``, hence
``(I + A) U = beta (V - exp(G) K S0)``,  ``A[t, s] = beta_t exp(G_t - G_s) k_t.k_s``  (s a proper ancestor),
``O = exp(G) Q S0 + ((Q K^T) * exp(G_t - G_s) * M) U``   (M: ancestor-or-self mask).
For a chain chunk M is ``tril`` and G a cumsum (the chunked form of the paper, section 3; the
same algebra as transformers' ``torch_chunk_gated_delta_rule``). For a tree in topological order
(parent index < child index) M is the ancestor mask and G the path cumsum ``G = M g``: each node
then depends on its own root path only, so siblings never mix; ``I + A`` stays unit lower
triangular and one triangular solve gives every node's u. Committing the accepted path is the
closed-form ``fold``: ``S* = exp(G_leaf) S0 + sum_{j on path} exp(G_leaf - G_j) k_j u_j^T``.

``per_node`` is the second exact method: one recurrence step per node in topological order,
starting from its parent's state, keeping every node's state (commit = copy the accepted node's).

Shapes: token-major q, k ``[n, H, Kd]`` (already repeated from key heads to the H value heads),
v ``[n, H, Vd]``, g, beta ``[n, H]``; state ``[H, Kd, Vd]``; all fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 64


def _intra(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, anc: Tensor):
    """State-free part of blocks: q, k ``[B, H, C, Kd]``, v ``[B, H, C, Vd]``, g, beta ``[B, H, C]``,
    anc bool ``[C, C]`` (ancestor-or-self) or ``[B, C, C]`` (one per block). Returns G ``[B, H, C]``, U0 = (I+A)^-1 beta V,
    W = (I+A)^-1 beta exp(G) K and P = (Q K^T) * decay * M."""
    G = g @ anc.to(g.dtype).transpose(-1, -2)                             # path cumsum
    see = anc if anc.dim() == 2 else anc[:, None]                         # [B, C, C]: one per block
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~see, float("-inf")).exp()
    lower = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]        # strict part is read
    rhs = torch.cat((v, k * G.exp()[..., None]), dim=-1) * beta[..., None]
    sol = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    p = (q @ k.transpose(-1, -2)) * decay
    return G, sol[..., : v.shape[-1]], sol[..., v.shape[-1]:], p


def tree_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
               anc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """All nodes of one block (a tree or a chain chunk) from ``state``, which is not changed.

    anc: bool ``[n, n]`` ancestor-or-self mask in topological order. Returns o ``[n, H, Vd]``,
    u ``[n, H, Vd]`` and G ``[n, H]`` (what ``fold`` needs to commit a path)."""
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    G, u0, w, p = _intra(qh, kh, vh, g.t()[None], beta.t()[None], anc)
    u = u0[0] - w[0] @ state
    o = (qh[0] @ state) * G[0].exp()[..., None] + p[0] @ u
    return o.transpose(0, 1), u.transpose(0, 1), G[0].t()


def fold(state: Tensor, k: Tensor, u: Tensor, G: Tensor) -> Tensor:
    """State after a root path whose nodes (in order, leaf last) have k ``[..., m, H, Kd]``,
    u ``[..., m, H, Vd]``, G ``[..., m, H]``; state ``[..., H, Kd, Vd]`` before the block.
    Leading dims (e.g. all GDN layers at once) broadcast. Returns the new state."""
    last = G[..., -1:, :]
    upd = torch.einsum("...mhk,...mhv->...hkv", k * (last - G).exp()[..., None], u)
    return state * last[..., 0, :].exp()[..., None, None] + upd


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
            chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """A causal sequence of n tokens from ``state`` (prefill): chunks of ``chunk`` tokens, the
    state-free work batched over chunks, then one pass over the chunks. Returns o ``[n, H, Vd]``
    and the state after the last token."""
    n = q.shape[0]
    if n == 1:
        return step(q[0], k[0], v[0], g[0], beta[0], state)
    pad = (-n) % chunk
    c = min(chunk, n)
    if pad and n > chunk:  # padded rows: beta = g = 0, k = v = 0 -> no effect on the state
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    b = q.shape[0] // c
    qh, kh, vh = (x.view(b, c, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))  # [B, H, C, D]
    gh, bh = (x.view(b, c, -1).transpose(1, 2) for x in (g, beta))
    anc = torch.ones(c, c, dtype=torch.bool, device=q.device).tril_()
    G, u0, w, p = _intra(qh, kh, vh, gh, bh, anc)
    qe = qh * G.exp()[..., None]
    ke = kh * (G[..., -1:] - G).exp()[..., None]
    tail = G[..., -1].exp()[..., None, None]
    out = []
    for i in range(b):
        u = u0[i] - w[i] @ state
        out.append(qe[i] @ state + p[i] @ u)
        state = state * tail[i] + ke[i].transpose(-1, -2) @ u
    o = torch.stack(out).transpose(1, 2).reshape(b * c, *v.shape[1:])
    return o[:n], state


def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token: q, k ``[H, Kd]``, v ``[H, Vd]``, g, beta ``[H]``. Returns o ``[1, H, Vd]`` and the
    new state (a new tensor)."""
    o, s = steps(q, k, v, g, beta, state)
    return o[None], s


def steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of several requests (leading dims broadcast, e.g. ``[b]``): q, k
    ``[..., H, Kd]``, v ``[..., H, Vd]``, g, beta ``[..., H]``, state ``[..., H, Kd, Vd]``.
    Returns o ``[..., H, Vd]`` and the new states (a new tensor)."""
    s = state * g.exp()[..., None, None]
    u = (v - torch.einsum("...hkv,...hk->...hv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return torch.einsum("...hkv,...hk->...hv", s, q), s


def tree_chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                anc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``tree_chunk`` of b blocks at once, padded to r rows: q, k ``[b, r, H, Kd]``, v
    ``[b, r, H, Vd]``, g, beta ``[b, r, H]``, state ``[b, H, Kd, Vd]``, anc bool ``[b, r, r]``
    (a padding row: zero inputs, no ancestors). Returns o, u ``[b, r, H, Vd]``, G ``[b, r, H]``."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    G, u0, w, p = _intra(qh, kh, vh, g.transpose(1, 2), beta.transpose(1, 2), anc)
    u = u0 - w @ state
    o = (qh @ state) * G.exp()[..., None] + p @ u
    return o.transpose(1, 2), u.transpose(1, 2), G.transpose(1, 2)


def per_node(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
             parent: Tensor, states: Tensor) -> Tensor:
    """Sequential per-node verification: node i starts from its parent's state (``state`` for
    the root, parent -1), takes one step and stores its state in ``states[i + 1]``.

    parent: long ``[n]`` on the device (no host sync); states: ``[>= n + 1, H, Kd, Vd]`` buffer,
    slot 0 receives ``state``. Returns o ``[n, H, Vd]``."""
    states[0].copy_(state)
    src = parent + 1
    out = []
    for i in range(q.shape[0]):
        s = states.index_select(0, src[i:i + 1])[0]
        o, s = step(q[i], k[i], v[i], g[i], beta[i], s)
        states[i + 1].copy_(s)
        out.append(o)
    return torch.cat(out)
