"""Per-request decoding parameters, torch-free: the API, the CLI and the benchmarks build them
without loading the engine; engine/sampling.py applies them to the target's logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures below this are greedy decoding (argmax), the limit of softmax(logits / T) as T -> 0.
# Same threshold as vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py). Below it, logits / T can
# overflow fp32 (T = 1e-39 is a denormal, 5e-324 rounds to 0 in fp32) and the sampler would see
# NaN; at or above it, `processed_probs` is finite for every finite logit row (it subtracts the
# row maximum before dividing, so the largest scaled logit is exactly 0).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding parameters (docs/architecture.md, Engine contract).

    max_tokens: >= 1 new tokens; temperature: finite, >= 0; below GREEDY_TEMPERATURE (1e-5,
    0 included) -> greedy (exact); top_p in (0, 1]: a top_p so small that it rounds to 0 in fp32
    keeps only the most probable token (the nucleus is never empty);
    seed: seeds the request's torch.Generator (None: random); stop: stop strings;
    stop_token_ids: extra stop tokens (EOS is always added by the engine unless ignore_eos).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if int(self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature below GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE
