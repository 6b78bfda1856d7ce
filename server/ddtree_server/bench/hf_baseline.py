"""Outside baseline: transformers' own `generate()` with a static KV cache, greedy, batch 1.

The same target weights are loaded as a plain transformers model (from an HF folder or the GGUF,
dequantised by transformers). `cache_implementation="static"` lets transformers use its compiled
decode step where it supports it (the strongest plain-transformers baseline seen, about 270
tokens/s against 35 with the dynamic cache: docs/benchmarks/README.md, "Measurements behind the
engine's design"). The first call, which compiles, is a warm-up.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ddtree_server.bench.timing import sync


class HFBaseline:
    """transformers model + `generate()` timing (CUDA-synchronised wall clock)."""

    def __init__(self, model, eos_token_ids: list[int]):
        self.model = model.eval()
        self.eos = list(eos_token_ids)
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, *, target: str | Path | None, gguf: str | Path | None, device: str, dtype: torch.dtype,
             eos_token_ids: list[int]) -> "HFBaseline":
        """Load the target with transformers (exactly one of target folder / gguf file)."""
        from transformers import AutoModelForCausalLM

        if gguf is not None:
            g = Path(gguf)
            model = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
        return cls(model.to(device), eos_token_ids)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy continuation ids (EOS included when reached) and wall seconds."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, cache_implementation="static",
                                  eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None)
        sync(self.device)
        return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0

    def record(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """A runner record for one prompt (tokens/s over the whole call, prefill included)."""
        new, secs = self.generate(prompt_ids, max_new_tokens)
        n = len(new)
        return {"method": "hf-generate", "mode": "hf-generate", "budget": None, "temperature": 0.0,
                "prompt_tokens": len(prompt_ids), "tokens": n, "rounds": n, "tau": 1.0, "decode_s": secs,
                "prefill_s": 0.0, "e2e_s": secs, "tokens_per_s": n / secs if secs > 0 else 0.0}
