"""Slot pools: the per-request caches of the batch engine with a leading request (slot) axis.

Every tensor of a model's cache (the target's KV ``k, v``; for hybrids also the GDN ``state``,
``conv``; the drafter's context K/V) is allocated once as ``[slots, ...]`` (a hybrid's verify
scratch too with the ``node`` method; the ``chunk`` method's is one shared scratch per round,
``runner.py``, left out of the slots), and slot i's cache object holds views ``pool[i]``. Slot-major order keeps
each slot one contiguous cache, so the per-request code (kernels, CUDA graphs, compaction, the
GDN fold) runs on a slot unchanged, and the batched forwards gather ``pool[slots_of_batch]``.

Admission resets the slot (length 0, zero recurrent / conv state); rows past a request's length
hold zeros or a previous request's K/V, and every reader masks them. They must stay finite: the
padded batch-1 device round (``solo_round.py``) reads them with zero weights, and 0 * NaN is NaN
(a pool of NaN instead of zeros fails test_solo_round). ``poison`` fills a freed slot with NaN
(debug for the batched rounds: a leak of stale state then shows as NaN in an output).
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)


def _tensor_fields(obj) -> list[tuple[object, str, Tensor]]:
    """The tensors of a cache object and of its nested objects, except objects marked ``shared``
    (one buffer of many caches, e.g. the hybrid verify scratch of the batch engine's rounds)."""
    out = []
    for name, value in vars(obj).items():
        if isinstance(value, Tensor):
            out.append((obj, name, value))
        elif hasattr(value, "__dict__") and not getattr(value, "shared", False) and any(
                isinstance(v, Tensor) for v in vars(value).values()):
            out.extend(_tensor_fields(value))
    return out


def cache_bytes(cache) -> int:
    """Bytes of the tensors of a cache object (nested objects included, shared ones not)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensor_fields(cache))


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.eye}


class _OnMeta(TorchFunctionMode):
    """Tensor factories called in this mode allocate on the meta device (shapes and dtypes only)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def slot_cache_bytes(cache) -> int:
    """Bytes of ``cache`` as a batch-engine slot: ``cache_bytes`` less an own ``chunk`` verify
    scratch, which the engine replaces by one scratch per round (``round_scratch_bytes``)."""
    scratch = getattr(cache, "scratch", None)
    own = scratch is not None and not scratch.shared and scratch.method == "chunk"
    return cache_bytes(cache) - (scratch.nbytes if own else 0)


def measured(build, size=slot_cache_bytes) -> int:
    """``size`` of the cache ``build()`` makes, built on the meta device (nothing allocated: a
    27B-shape slot at its full context is 17 GiB); built for real where a constructor needs
    tensor values (then allocated and freed)."""
    try:
        with _OnMeta():
            return size(build())
    except (NotImplementedError, RuntimeError) as exc:   # an op without a meta kernel
        log.debug("measuring a cache on the meta device failed (%s); building it", exc)
        return size(build())


def _clone(obj, memo: dict):
    """Shallow copy of ``obj`` and of its nested tensor-holding objects (memo: id -> copy)."""
    out = copy.copy(obj)
    memo[id(obj)] = out
    for key, value in vars(obj).items():
        if not isinstance(value, Tensor) and hasattr(value, "__dict__") and not getattr(value, "shared", False) \
                and _tensor_fields(value):
            setattr(out, key, _clone(value, memo))
    return out


class SlotPool:
    """``slots`` cache objects built from ``make()`` (a fresh cache), whose tensors share pooled
    storage ``[slots, ...]`` when ``pooled`` (the cache is a plain object of tensors), else are
    independent caches (test doubles, transformers caches)."""

    def __init__(self, make, slots: int, pooled: bool = True):
        template = make()
        self.pooled = pooled
        if not pooled:
            self.caches = [template] + [make() for _ in range(slots - 1)]
            self.tensors: dict[str, Tensor] = {}
            return
        fields = _tensor_fields(template)
        self.tensors = {}
        for i, (_, name, t) in enumerate(fields):
            pool = torch.empty((slots, *t.shape), dtype=t.dtype, device=t.device)
            pool.copy_(t.expand_as(pool))   # every slot a fresh cache (one pass over the memory)
            self.tensors[f"{i}:{name}"] = pool
        self.caches = []
        for s in range(slots):
            memo: dict[int, object] = {}
            cache = _clone(template, memo)
            for (obj, name, _), pool in zip(fields, self.tensors.values()):
                setattr(memo[id(obj)], name, pool[s])
            self.caches.append(cache)
        del template

    def __getitem__(self, slot: int):
        return self.caches[slot]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's cache (every tensor of it)."""
        if self.pooled:
            return sum(t[0].numel() * t.element_size() for t in self.tensors.values())
        return cache_bytes(self.caches[0])

    def pool(self, name: str) -> Tensor:
        """The pooled tensor of a cache attribute (``k``, ``v``, ``state`` ...; the first match)."""
        for key, t in self.tensors.items():
            if key.split(":", 1)[1] == name:
                return t
        raise KeyError(name)

    def poison(self, slot: int) -> None:
        """Fill every floating tensor of ``slot`` with NaN (debug mode for freed slots)."""
        for t in (self.tensors.values() if self.pooled else []):
            if t.is_floating_point():
                t[slot].fill_(float("nan"))
