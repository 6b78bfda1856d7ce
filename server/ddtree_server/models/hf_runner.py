"""Fallback runner: plain decoding through transformers' own model.

Used for targets neither TargetModel nor HybridTarget (Qwen3.5 / Qwen3.6 dense hybrids) runs:
other hybrid / recurrent / linear-attention architectures such as Qwen3.5-MoE, Qwen3-Next, Mamba,
Jamba, and any other model_type we do not implement. It offers the TargetModel calling
convention for the ``ar`` loop only: no tree masks, no compaction, no captured features.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import Tensor

from ddtree_server.models.common import LoadedTarget, eos_ids


class HFCache:
    """Wraps whatever cache object the transformers model returns; only appending is supported."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.past = None

    def reset(self) -> None:
        """Drop the cached state."""
        self.length = 0
        self.past = None

    def keep(self, start: int, rows) -> None:
        """Unsupported: recurrent state cannot be compacted (raises NotImplementedError)."""
        raise NotImplementedError("KV compaction is not available for the fallback runner")


class HFRunner:
    """``forward(cache, input_ids [n], positions [n]) -> (logits [n, vocab], None)`` over an HF model."""

    capture_layers: list[int] = []

    def __init__(self, model):
        self.model = model.eval()
        self.config = model.config
        self.capture_layers = []
        # transformers >= 5.2x renamed the forward kwarg past_key_values -> cache (old name deprecated)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def embed_tokens(self):
        return self.model.get_input_embeddings()

    @property
    def lm_head(self):
        return self.model.get_output_embeddings()

    def new_cache(self, max_len: int) -> HFCache:
        """A fresh, empty HFCache."""
        return HFCache(max_len)

    @torch.inference_mode()
    def forward(self, cache: HFCache, input_ids: Tensor, positions: Tensor,
                tree_mask: Tensor | None = None, last_only: bool = False) -> tuple[Tensor, None]:
        """Append ``n`` tokens; returns logits ``[n, vocab]`` (``[1, vocab]`` with last_only).

        Raises:
            NotImplementedError: a tree mask was given (tree mode is unavailable here).
            ValueError: the cache would exceed ``max_len`` or positions are not contiguous.
        """
        if tree_mask is not None:
            raise NotImplementedError("tree verification is not available for this architecture")
        n = input_ids.shape[0]
        if cache.length + n > cache.max_len:
            raise ValueError(f"cache full: {cache.length} + {n} > {cache.max_len}")
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=True,
                         logits_to_keep=1 if last_only else 0, **{self._cache_kw: cache.past})
        past = getattr(out, "cache", None)
        cache.past = past if past is not None else out.past_key_values
        cache.length += n
        return out.logits[0], None

    __call__ = forward


def load_hf_folder(src: Path, config, dtype: torch.dtype, device: torch.device, message: str) -> LoadedTarget:
    """``models.load.load_target`` for a family we do not run: transformers' model in an HFRunner,
    plain decoding only (``tree_mode_available=False``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    model = HFRunner(AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device))
    return LoadedTarget(model=model, tokenizer=tokenizer, config=config, tree_mode_available=False,
                        message=message, folder=src, eos_token_ids=eos_ids(src, config, tokenizer),
                        max_position_embeddings=getattr(config, "max_position_embeddings", None))
