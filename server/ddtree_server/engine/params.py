"""Per-request decoding parameters, torch-free: the API, the CLI and the benchmarks build them
without loading the engine; engine/sampling.py applies them to the target's logits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy decoding (argmax), the limit of softmax(logits / T) as T -> 0.
# Same threshold as vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py). Below it, logits / T can
# overflow fp32 (T = 1e-39 is a denormal, 5e-324 rounds to 0 in fp32) and the sampler would see
# NaN; at or above it, `processed_probs` is finite for every finite logit row (it subtracts the
# row maximum before dividing, so the largest scaled logit is exactly 0).
GREEDY_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 100.0)   # beyond it logits / penalty overflows fp32 (a 5e-324 penalty gives inf)
MAX_TOP_LOGPROBS = 20     # most alternatives per emitted token (OpenAI's top_logprobs maximum)


@dataclass
class SamplingParams:
    """Per-request decoding parameters (docs/architecture.md, Engine contract).

    max_tokens: >= 1 new tokens; temperature: finite, >= 0; below GREEDY_TEMPERATURE (1e-5,
    0 included) -> greedy (exact); top_p in (0, 1]: a top_p so small that it rounds to 0 in fp32
    keeps only the most probable token (the nucleus is never empty);
    seed: keys the sampling draws (engine/batch/rng.py; None: random); stop: stop strings;
    stop_token_ids: extra stop tokens (EOS is always added by the engine unless ignore_eos).
    Logits processing (engine/processors.py, applied per tree node, exact under speculation):
    presence_penalty / frequency_penalty in [-2, 2] (0 = off), repetition_penalty in [0.01, 100] (1 = off),
    logit_bias: token id -> bias in [-100, 100], grammar: a ``constrained.compiler.Grammar`` (None =
    unconstrained). logprobs: None = off, else 0..MAX_TOP_LOGPROBS alternatives per emitted token
    (engine/logprobs.py).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0           # keep the k most probable tokens before top_p (0 = off, vLLM's order)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    grammar: Any = None

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
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        for tok, bias in self.logit_bias.items():
            if not (isinstance(tok, int) and tok >= 0):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= int(self.logprobs) <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature below GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE
