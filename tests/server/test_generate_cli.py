"""`ddtree-server generate` end to end on the real SmolLM2 (CPU, fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ddtree_server.cli import app

pytestmark = pytest.mark.slow


def _run(*args):
    result = CliRunner().invoke(app, ["generate", *args, "--device", "cpu", "--dtype", "fp32", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def drafter_dir(smollm2, tmp_path_factory):
    """A randomly initialised DFlash drafter for SmolLM2, saved in z-lab format."""
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.config import DrafterConfig
    from ddtree_server.models.drafter.load import save_drafter

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 8,
           "dflash_config": {"mask_token_id": 0, "target_layer_ids": [2, 15, 27]},
           "num_hidden_layers": 1, "hidden_size": 576, "intermediate_size": 256,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
           "vocab_size": 49152, "rope_theta": 100000.0, "num_target_layers": 30}
    torch.manual_seed(0)
    m = smollm2.model
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw), m.embed_tokens, m.lm_head)
    return save_drafter(drafter, tmp_path_factory.mktemp("drafter"), dtype=torch.float32)


def test_generate_json_ar_and_ddtree_agree(drafter_dir):
    ar = _run("Name three colours.", "--max-tokens", "16", "--mode", "ar")
    dd = _run("Name three colours.", "--max-tokens", "16", "--drafter", str(drafter_dir),
              "--mode", "ddtree", "--tree-budget", "12")
    assert ar["token_ids"] == dd["token_ids"] and ar["text"] == dd["text"]
    assert ar["stats"]["mode"] == "ar" and dd["stats"]["mode"] == "ddtree"
    assert dd["stats"]["tree_budget"] == 12 and dd["stats"]["block_size"] == 8
    assert ar["finish_reason"] in ("stop", "length") and ar["model"] == "SmolLM2-135M-Instruct"


def test_generate_streams_text_and_stats():
    result = CliRunner().invoke(app, ["generate", "2+2=", "--raw", "--max-tokens", "5", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "mean_acceptance_length" in result.output


def test_generate_bad_mode_is_a_clean_error():
    result = CliRunner().invoke(app, ["generate", "hi", "--mode", "beam", "--device", "cpu"])
    assert result.exit_code != 0
    assert "mode" in result.output and "Traceback" not in result.output
