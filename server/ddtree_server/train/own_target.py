"""train-drafter on a target that transformers cannot run as we serve it: our own forward.

Qwen3.5 / Qwen3.6 hybrid folders (multimodal layout, Gated DeltaNet layers) load as our
HybridTarget (models/hybrid/); ``OwnTarget`` gives the trainer what it expects of a transformers
causal LM: ``config``, ``generation_config``, ``get_input_embeddings`` / ``get_output_embeddings``,
``generate`` (batched left-padded prompts -> prompt + answer, one sequence at a time through the
engine's ``ar_loop``: greedy, or plain temperature sampling seeded from the global RNG) and
``target_features`` (the captured decoder-layer outputs of our forward, which is exactly what the
drafter sees when served; train/features.py calls it). Batch rows run one by one (batch-1 caches).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn


class OwnTarget(nn.Module):
    """A frozen target of ours (``forward(cache, ids, positions)``, ``capture_layers``) seen as an LM."""

    def __init__(self, model: nn.Module, eos_token_ids: list[int]):
        super().__init__()
        self.model = model
        self.config = model.config
        self.generation_config = SimpleNamespace(eos_token_id=list(eos_token_ids))

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.model.lm_head

    @torch.no_grad()
    def target_features(self, input_ids: Tensor, layer_ids: list[int]) -> Tensor:
        """input_ids ``[B, T]`` (right padding only) -> ``[B, T, len(layer_ids) * hidden]``.
        Runs outside autocast: the recurrent state math stays fp32."""
        if max(layer_ids) >= len(self.model.layers):
            raise IndexError(f"layer id {max(layer_ids)} >= target depth {len(self.model.layers)}")
        saved, self.model.capture_layers = self.model.capture_layers, list(layer_ids)
        dev, t = input_ids.device, input_ids.shape[1]
        try:
            with torch.autocast(dev.type, enabled=False):
                rows = [self.model.forward(self.model.new_cache(t), row, torch.arange(t, device=dev))[1]
                        for row in input_ids]
        finally:
            self.model.capture_layers = saved
        return torch.stack(rows)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, pad_token_id: int,
                 eos_token_id, do_sample: bool = False, temperature: float = 1.0, **_ignored) -> Tensor:
        """Left-padded prompts ``[B, W]`` -> ``[B, W + max_new_tokens]``: each row's answer
        after the prompt, cut after its first EOS and padded with ``pad_token_id``."""
        from ddtree_server.engine.decode import ar_loop
        from ddtree_server.engine.sampling import SamplingParams, TokenChooser

        eos = set(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])
        dev = input_ids.device
        out = torch.full((input_ids.shape[0], input_ids.shape[1] + max_new_tokens), pad_token_id,
                         dtype=torch.long, device=dev)
        out[:, : input_ids.shape[1]] = input_ids
        for r in range(input_ids.shape[0]):
            prompt = input_ids[r][attention_mask[r].bool()].tolist()
            seed = int(torch.randint(0, 2**31 - 1, (1,)))
            params = SamplingParams(max_tokens=max_new_tokens, temperature=float(temperature) if do_sample else 0.0,
                                    seed=seed)
            cache = self.model.new_cache(len(prompt) + max_new_tokens + 1)
            answer: list[int] = []
            for step in ar_loop(self.model, cache, prompt, TokenChooser(params, dev), dev):
                answer += step
                if answer[-1] in eos or len(answer) >= max_new_tokens:
                    break
            out[r, input_ids.shape[1]: input_ids.shape[1] + len(answer)] = torch.tensor(answer, device=dev)
        return out


def is_own_target_folder(folder) -> bool:
    """True when ``folder``'s config.json is a family that only our forward runs (models/families.py:
    ``train_own_forward``; today the Qwen3.5 hybrids)."""
    import json
    from pathlib import Path

    from ddtree_server.models.families import family_of

    path = Path(folder) / "config.json"
    try:
        return family_of(json.loads(path.read_text())).train_own_forward
    except (OSError, ValueError):
        return False
