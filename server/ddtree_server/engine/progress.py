"""Progress inside an engine round, for the worker's stall detection (api/worker.py).

A decode round takes milliseconds, but a long prompt's prefill is one round of minutes on a CPU
(a 7,909-token prompt took 314 s on a loaded 2-core machine, past the default --stall-seconds
300). ``Beacon.watch(model)`` puts a forward pre-hook on every layer of the model's layer lists
(the decoder layers of the target, dense or hybrid) and on their direct parts (norms,
attention or mixer, MLP): each one that starts records the time, so
a long prefill keeps showing progress while a round that hangs (a wedged device, a deadlock)
stops doing so. CUDA-graph replays run no Python hooks: their rounds are short and the round's
own start time is their progress. Torch is not imported here; ``watch`` uses the module's own API.
"""

from __future__ import annotations

import time
from typing import Any


class Beacon:
    """The last time a watched layer started a forward (``time.monotonic()``; None: never)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def beat(self, *_: Any) -> None:
        """Record progress now (the hook's signature: module, inputs)."""
        self.at = time.monotonic()

    def last(self) -> float | None:
        return self.at

    def watch(self, model: Any) -> int:
        """Hook every child of every ``ModuleList`` in ``model`` (an ``nn.Module``, or a wrapper
        such as GraphedTarget / GraphedDrafter whose ``.model`` / ``.drafter`` is one). Returns how
        many layers are watched (0 for None)."""
        for _ in range(4):   # unwrap GraphedTarget / GraphedHybrid / GraphedDrafter / HFRunner
            if hasattr(model, "named_modules") and hasattr(model, "register_forward_pre_hook"):
                break
            model = getattr(model, "model", None) or getattr(model, "drafter", None)
        if model is None or not hasattr(model, "named_modules"):
            return 0
        count = 0
        for _, module in model.named_modules():
            if type(module).__name__ == "ModuleList":
                for layer in module:
                    # the layer and its direct parts (attention / mixer, MLP, norms): a beat
                    # within each layer of a long prompt, at a few hooks per layer (a hook on every
                    # projection costs Python time on every eager forward)
                    for part in (layer, *layer.children()):
                        part.register_forward_pre_hook(self.beat)
                    count += 1
        return count
