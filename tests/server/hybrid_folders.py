"""Write tiny random Qwen3.5 checkpoint folders as the real releases lay them out (no download).

* text-only: ``Qwen3_5ForCausalLM.save_pretrained`` (``model.layers.*``, ``model_type``
  ``qwen3_5_text``);
* multimodal: transformers' own ``Qwen3_5ForConditionalGeneration`` with a one-block vision tower
  (``model.language_model.*``, ``model.visual.*``, ``model_type`` ``qwen3_5``, ``text_config``),
  optionally sharded with the vision tower alone in its own file.
Both get a word-level tokenizer with a chat template, so the real server can load them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.server.hybrid_fixtures import random_state, tiny_config

WORDS = ("the a cat dog sat on mat ran fast slow why how what is are you me we it to and of in "
         "blue sky red sun green tree one two three four five").split()
CHAT = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant {% endif %}")
SPECIALS = ["<unk>", "<eos>", "<mask>", "<s>", "user", "assistant", "system"]


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (ids 0..6 specials, then WORDS) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")
    tok.chat_template = CHAT
    tok.save_pretrained(folder)


def write_hybrid_folder(folder: Path, *, multimodal: bool, seed: int = 0, pattern: str = "3gdn+attn",
                        split_vision: bool = False, drop: str | None = None, vocab: int = 260,
                        scale: float = 3.0) -> Path:
    """A tiny Qwen3.5 folder (config, safetensors, tokenizer); its language model has the
    weights of ``random_state(tiny_config(pattern), seed)``. Returns the folder."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(pattern, vocab=vocab, eos_token_id=1, pad_token_id=1)
    state = random_state(cfg, seed, scale=scale)
    if not multimodal:
        model = Qwen3_5ForCausalLM(cfg)
        model.load_state_dict(state)
        model.save_pretrained(folder)
        tensors = {k: v.contiguous() for k, v in state.items()}
        config_doc = json.loads((folder / "config.json").read_text())
    else:
        mm_cfg = Qwen3_5Config(text_config=cfg.to_dict(), vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=cfg.hidden_size))
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(mm_cfg)
        model.save_pretrained(folder)
        config_doc = json.loads((folder / "config.json").read_text())
        tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("model.visual.")}
        for k, v in state.items():
            name = "lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]
            tensors[name] = v.contiguous()
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    if drop:
        tensors.pop(drop)
    if split_vision:
        files = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if not k.startswith("model.visual.")},
                 "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("model.visual.")}}
        for name, part in files.items():
            save_file(part, str(folder / name), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: n for n, part in files.items() for k in part}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_doc, indent=1))
    write_tokenizer(folder)
    return folder
