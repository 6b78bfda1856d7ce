"""Answering prompts with the target for training data: which engine, and checking it.

The static engine (train/generate.py) is ~10-20x faster than transformers' `generate()` at large
batch; it is checked on its first batch (greedy agreement under teacher forcing), and any doubt
sends the run to `generate()`, which is slow but is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ddtree_server.train import generate as static_gen


@dataclass(frozen=True)
class GenSettings:
    """Data generation settings (tokens / seconds)."""

    max_prompt_tokens: int = 256     # longer chat-formatted prompts are skipped
    max_new_tokens: int = 256
    batch_size: int = 256
    sampled_fraction: float = 0.25   # share of pass-0 jobs answered with temperature sampling
    temperature: float = 0.8
    seed: int = 0
    engine: str = "static"           # static (train/generate.py) | hf (transformers generate())


@torch.no_grad()
def hf_generate(model: nn.Module, batch: list[list[int]], sampled: bool, s: GenSettings, pad_id: int,
                 eos_ids: list[int]) -> list[list[int]]:
    """transformers' batched `generate()` over left-padded prompts (all greedy or all sampled at
    s.temperature, top-k 0, top-p 1); responses cut after the first stop token."""
    dev = next(model.parameters()).device
    width = max(len(x) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, x in enumerate(batch):
        ids[r, width - len(x):] = torch.tensor(x)
        mask[r, width - len(x):] = 1
    kw = dict(do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0) if sampled else dict(do_sample=False)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=s.max_new_tokens,
                         pad_token_id=pad_id, eos_token_id=eos_ids, **kw)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
        responses.append(row[:cut])
    return responses


class Answerer:
    """Answers batches of prompts: `engine` "static" (StaticGenerator, checked on its first batch
    against the target's own argmax) or "hf" (transformers' `generate()`, greedy and sampled rows
    in separate calls). Falls back from static to hf, for the rest of the run, when the model is
    not supported, the generator raises, or its greedy agreement is below 0.85; every switch is
    reported as a "stage" event. A batch that runs out of GPU memory is answered in halves."""

    def __init__(self, model, s: GenSettings, pad_id: int, eos_ids: list[int], report) -> None:
        self.model, self.s, self.pad_id, self.eos_ids, self.report = model, s, pad_id, eos_ids, report
        self.engine = s.engine if s.engine == "hf" or static_gen.supports(model) else "hf"
        self.checked = False
        self.gen = static_gen.StaticGenerator(model, eos_ids) if self.engine == "static" else None

    def __call__(self, prompts: list[list[int]], sampled: list[bool], seed: int) -> list[list[int]]:
        if self.engine == "static":
            try:
                out, _ = self.gen.generate(prompts, sampled, max_new_tokens=self.s.max_new_tokens,
                                           temperature=self.s.temperature, seed=seed, pad_id=self.pad_id)
            except torch.cuda.OutOfMemoryError:
                if len(prompts) < 2:
                    raise
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                half = len(prompts) // 2  # the KV cache grows with the rows: answer the halves apart
                self.report("stage", {"stage": "static generator out of memory", "rows": len(prompts)})
                return self(prompts[:half], sampled[:half], seed) + self(prompts[half:], sampled[half:], seed + 1)
            except (RuntimeError, ValueError) as exc:  # e.g. an attention kernel this device lacks
                self._fall_back(f"static generator failed: {exc}")
                return self(prompts, sampled, seed)
            if not self.checked:
                self.checked = True
                score = self._check(prompts[:8])
                if score < 0.85:  # bf16 near-ties flip a few percent; a broken cache or mask scores far lower
                    self._fall_back(f"greedy agreement {score:.3f} < 0.85")
                    return self(prompts, sampled, seed)
            return out
        out: list[list[int] | None] = [None] * len(prompts)
        for flag in (False, True):
            rows = [k for k, f in enumerate(sampled) if f == flag]
            if rows:
                torch.manual_seed(seed + int(flag))
                for k, resp in zip(rows, hf_generate(self.model, [prompts[k] for k in rows], flag, self.s,
                                                      self.pad_id, self.eos_ids)):
                    out[k] = resp
        return out  # type: ignore[return-value]

    def _check(self, prompts: list[list[int]]) -> float:
        """Greedy agreement of up to 64 greedy tokens for `prompts` (whatever their sampled flags)."""
        out, _ = self.gen.generate(prompts, [False] * len(prompts), max_new_tokens=min(64, self.s.max_new_tokens),
                                   pad_id=self.pad_id)
        score = static_gen.greedy_agreement(self.model, prompts, out)
        self.report("stage", {"stage": "static generator check", "greedy_agreement": round(score, 4)})
        return score

    def _fall_back(self, why: str) -> None:
        self.report("stage", {"stage": "generate() fallback", "why": why[:300]})
        self.engine, self.gen = "hf", None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
