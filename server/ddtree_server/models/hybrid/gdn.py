"""Gated DeltaNet layer of Qwen3.5 / Qwen3.6 (transformers ``Qwen3_5GatedDeltaNet``), tree-aware.

Per token: ``[qkv | z | b | a] = in_proj(x)`` (one fused GEMM over the checkpoint's
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); a depthwise causal conv1d of width
K over qkv, then SiLU; q, k l2-normalised (eps 1e-6), q scaled by Kd^-0.5, key heads repeated to
the value heads; ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``; the gated
delta rule (``delta.py``); ``RMSNormGated(o, z)`` (norm, weight, then ``* silu(z)``); out_proj
(applied by the caller, fused with the residual add).

Recurrent state in fp32 (reduced-precision node states drift), conv inputs in the model dtype.
Three ways through ``forward`` (``ctx.mode``):
* ``commit``: a causal chain committed at once (1 token = one step, longer = chunked prefill);
* ``chunk``: pending block, tree-masked chunked rule; k, u, G kept for ``HybridCache.keep``;
* ``node``: pending block, per-node states kept; keep copies the accepted node's state.
On CUDA, decode steps and ``chunk`` blocks run on fused Triton kernels (``gdn_fast.py``,
``kernels/gdn_*.py``); ``mix`` (pure torch, every device) is their reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.models.hybrid import delta, gdn_fast


class GatedRMSNorm(nn.Module):
    """transformers ``Qwen3_5RMSNormGated``: ``weight * norm(o)`` in the model dtype, times ``silu(z)``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, o: Tensor, z: Tensor) -> Tensor:
        dtype = z.dtype
        normed = F.rms_norm(o.to(dtype).float(), (o.shape[-1],), None, self.eps).to(dtype)
        return (self.weight * normed * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One GDN token mixer; parameter names as transformers' except the fused ``in_proj``."""

    def __init__(self, cfg):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = cfg.conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _conv(self, ext: Tensor, n: int, meta) -> Tensor:
        """Conv + SiLU of the n new rows; ext ``[K-1+n', C]`` = committed state rows then inputs."""
        w = self.conv1d.weight[:, 0, :].float()  # [C, K]
        if meta.chain:
            out = F.conv1d(ext[: self.kernel - 1 + n].t()[None].float(), w[:, None, :], groups=self.conv_dim)[0].t()
        else:
            rows = ext.index_select(0, meta.win.reshape(-1)).view(n, self.kernel, -1)
            out = torch.einsum("nkc,ck->nc", rows.float(), w)
        return F.silu(out)

    def forward(self, x: Tensor, cache, li: int, ctx) -> Tensor:
        """x ``[n, hidden]`` (normed) -> gated, normed core output ``[n, value_dim]`` (before out_proj).
        li: this layer's index among the GDN layers (rows of the cache's GDN buffers). On CUDA the
        fused Triton kernels run where they apply (``gdn_fast``), else the pure-torch ``mix``."""
        proj = self.in_proj(x)
        if gdn_fast.usable(proj, cache, ctx):
            return gdn_fast.mix(self, proj, cache, li, ctx)
        return self.mix(proj, cache, li, ctx)

    def prepare(self, proj: Tensor, cache, li: int, meta):
        """Pure-torch path from the projection to the rule's inputs: conv rows written to the
        layer's buffer, conv + SiLU, q/k l2 norm, q scaling, key heads repeated to value heads,
        beta and g. Returns q, k ``[n, Hv, Dk]``, v ``[n, Hv, Dv]``, g, beta ``[n, Hv]`` (fp32),
        z ``[n, Hv, Dv]`` and the conv rows ``ext`` (committed state rows, then the block's)."""
        n, dtype = proj.shape[0], proj.dtype
        qkv, z, b, a = proj.split((self.conv_dim, self.value_dim, self.hv, self.hv), dim=-1)
        k1 = self.kernel - 1
        if n <= cache.cap:  # the block's inputs to the scratch, for the commit's conv state
            cache.inputs[li, :n] = qkv
        ext = torch.cat((cache.conv[li, :k1], qkv))
        q, k, v, g, beta = self.heads(self._conv(ext, n, meta).to(dtype).float(), b, a)
        return q, k, v, g, beta, z.view(n, self.hv, self.dv), ext

    def heads(self, mixed: Tensor, b: Tensor, a: Tensor):
        """From the conv + SiLU rows ``mixed`` ``[n, conv_dim]`` (fp32, model-dtype values) and the
        projection's b, a columns: q, k (l2-normed, q scaled, repeated to the value heads), v,
        g, beta (fp32; shapes as ``prepare``)."""
        n = mixed.shape[0]
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = _l2(q.view(n, self.hk, self.dk))
        k = _l2(k.view(n, self.hk, self.dk))
        rep = self.hv // self.hk
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = q * self.dk ** -0.5
        v = v.view(n, self.hv, self.dv)
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v, g, beta

    def mix(self, proj: Tensor, cache, li: int, ctx) -> Tensor:
        """The pure-torch mixer after the projection (the reference of the fused kernels)."""
        n, k1, meta = proj.shape[0], self.kernel - 1, ctx.meta
        q, k, v, g, beta, z, ext = self.prepare(proj, cache, li, meta)
        state = cache.state[li]
        if ctx.mode == "commit":
            o, new = delta.chunked(q, k, v, g, beta, state)
            state.copy_(new)
            cache.conv[li, :k1] = ext.index_select(0, meta.win[n - 1, 1:])
        elif ctx.mode == "chunk":
            o, u, G = delta.tree_chunk(q, k, v, g, beta, state, meta.anc)
            cache.kk[li, :n] = k
            cache.uu[li, :n] = u
            cache.GG[li, :n] = G
        else:
            o = delta.per_node(q, k, v, g, beta, state, meta.parent, cache.nodes[li])
        return self.norm(o, z).reshape(n, self.value_dim)


def _l2(x: Tensor) -> Tensor:
    """transformers' ``l2norm``: ``x * rsqrt(sum(x^2) + 1e-6)`` over the last axis."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)
