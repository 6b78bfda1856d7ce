"""When the engine uses its own Triton kernels (kernels/attention.py, fused.py, gdn_*.py).

``DDTREE_KERNELS`` decides, read at every forward (CUDA graphs are keyed by the answer):

* unset (default): on for CUDA tensors of an Ampere or newer GPU (compute capability >= 8.0)
  when Triton imports, off elsewhere (CPU keeps SDPA);
* ``0``: off everywhere (the SDPA / eager-op path of before, e.g. for an on/off comparison);
* ``1``: on wherever Triton can run: CUDA, and CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # the server runs without Triton (CPU installs): SDPA path
    HAVE_TRITON = False

ENV = "DDTREE_KERNELS"


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def enabled(device: torch.device | str) -> bool:
    """Whether forwards on ``device`` use the Triton kernels (see the module docstring)."""
    if not HAVE_TRITON:
        return False
    flag = os.environ.get(ENV, "").strip()
    if flag == "0":
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return _capability(device) >= (8, 0)
    return flag == "1" and device.type == "cpu" and interpreting()


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (2 for CPU tensors under the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count
