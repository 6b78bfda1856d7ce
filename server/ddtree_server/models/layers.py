"""Layer pieces every family shares: RMSNorm, the SwiGLU MLP, RoPE (frequencies of a config and the
half-split rotation), the fused residual add, and the attention-backend choice (Triton kernel path
or SDPA, and which SDPA backends on CUDA).

The maths mirrors transformers' Llama / Qwen modules (RMSNorm with fp32 statistics, RoPE from
``transformers.modeling_rope_utils`` so ``rope_parameters`` incl. llama3/yarn/linear scaling are
honoured, SwiGLU MLP).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddtree_server.kernels import runtime
from ddtree_server.kernels.attention import supported
from ddtree_server.kernels.fused import rms_norm as fused_rms_norm


# ---------------------------------------------------------------- attention-backend choice
def attention_backends(device: torch.device):
    """On CUDA, SDPA without cuDNN: cuDNN builds a new plan for every new key length, which costs
    tens of ms per decode step (the target's KV length grows by one per token, the draft cache every
    round); flash / memory-efficient / math remain. A no-op context elsewhere."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def kernels_usable(head_dim: int, weight: Tensor) -> bool:
    """True when forwards with this head size and weight dtype / device take the Triton kernel path
    (``kernels.runtime.enabled``: CUDA by default, ``DDTREE_KERNELS=0`` turns it off)."""
    return runtime.enabled(weight.device) and supported(head_dim, weight.dtype)


def norm_usable(x: Tensor) -> bool:
    """RMSNorm of x takes the Triton kernel (kernel path on, no autograd through it)."""
    return (runtime.enabled(x.device) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and not (x.requires_grad and torch.is_grad_enabled()))


# ---------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """RMSNorm over the last axis: one fused ``F.rms_norm`` (statistics in fp32 for half types), or
    the single-pass Triton kernel on the kernel path. The weight is cast to the input dtype when they
    differ (the drafter under bf16 autocast in training); otherwise it is used as is."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if norm_usable(x):
            return fused_rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


def check_silu(act: str) -> None:
    """The MLPs here are SwiGLU: any other ``hidden_act`` is a ValueError."""
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")


class MLP(nn.Module):
    """SwiGLU with a fused gate/up projection: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config):
        super().__init__()
        check_silu(getattr(config, "hidden_act", "silu"))
        bias = bool(getattr(config, "mlp_bias", False))
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def hidden(self, x: Tensor) -> Tensor:
        """The down projection's input ``silu(gate(x)) * up(x)``."""
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return F.silu(gate) * up


def linear_add(residual: Tensor, x: Tensor, linear: nn.Linear) -> Tensor:
    """``residual + linear(x)`` in one GEMM (addmm) when the layer has no bias."""
    if linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    return residual + linear(x)


# ---------------------------------------------------------------- RoPE
def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """RoPE in transformers' half-split layout, ``x * cos + rotate_half(x) * sin``, in 3 kernels:
    ``rotate_half(x) * sin == roll(x, half) * [-sin_a, sin_b]`` exactly (negation is exact), so the
    sign lives in ``sin_signed`` (computed once per forward) instead of a neg + cat per layer."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def rope_inv_freq(config) -> tuple[Tensor, float]:
    """Inverse RoPE frequencies ``[head_dim // 2]`` (fp32, CPU) and the attention scaling factor.

    Reads ``config.rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling`` (4.x).
    Non-default types go through ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``; dynamic
    types are evaluated once at the configured length (no per-length re-scaling).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = getattr(config, "partial_rotary_factor", 1.0) or 1.0
    dim = int(head_dim * partial)
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float().cpu(), float(scaling)
