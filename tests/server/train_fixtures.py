"""Shared helpers for the train-drafter tests: a tiny random Llama target with a word-level
tokenizer and a chat template, saved as an HF folder with a prompt file beside it; the
evaluation-wheel index for the contamination check."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = "the a cat dog sat on mat ran fast slow why how what is are you me we it to and".split()
CHAT = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}")


def make_tiny_target(folder: Path, n_prompts: int = 8) -> Path:
    """Write the tiny target (vocab 64, hidden 64, 4 layers, mask id 2) and `prompts.jsonl` into
    `folder`; returns the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "<mask>", "<s>", "user", "assistant"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=1, pad_token_id=1, bos_token_id=3)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    rng = torch.Generator().manual_seed(1)
    with open(folder / "prompts.jsonl", "w") as fh:
        for _ in range(n_prompts):
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6,), generator=rng)]
            fh.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    return folder


def eval_index_or_skip():
    """The contamination index over the four evaluation wheels in the wheel cache (the CLI's
    contamination check reads them); skips the calling test where they are not there."""
    import pytest
    from ddtree_server.data.wheels import DataFileError
    from ddtree_server.train.contamination import load_index

    try:
        return load_index()
    except DataFileError as exc:
        pytest.skip(f"evaluation wheels unavailable here: {exc}")
