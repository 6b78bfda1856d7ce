"""Test components for the engine tests: a byte tokenizer, a tiny random Qwen3 target, drafter doubles.

The target is our real TargetModel built from a randomly initialised transformers Qwen3 model
(weights scaled up so that next-token distributions are peaked, like a trained model's). The
drafters below are TEST DOUBLES (not trained models) that satisfy the drafter contract
(``config.block_size``, ``config.target_layer_ids``, ``new_cache``, ``propose``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ddtree_server.models.dense.load import build_target

VOCAB = 260
EOS = 256


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); 256 = EOS; 257..259 unused specials."""

    eos_token_id = EOS
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def token_bytes(self, i):
        """The bytes of token ``i`` (b"" for EOS and the unused specials): what a grammar
        compiler needs to know about a tokenizer that is not a transformers one."""
        return bytes([i]) if i < 256 else b""

    def __len__(self):
        return VOCAB

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def tiny_target(seed: int = 0, layers: int = 4, scale: float = 3.0, max_pos: int = 512):
    """A TargetModel (Qwen3 family: q/k norms, GQA 4/2 heads) with random weights, fp32, CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, max_position_embeddings=max_pos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = hf.state_dict()
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            state[name] = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
    state["lm_head.weight"] = state["lm_head.weight"] * scale
    return build_target(cfg, state, torch.float32, torch.device("cpu"))


# ------------------------------------------------------------------ drafter test doubles
class DoubleCache:
    """Draft cache of the test doubles: records the context features it was fed (rows = positions)."""

    def __init__(self, max_len: int, width: int):
        self.max_len = max_len
        self.length = 0
        self.feats = torch.zeros(max_len, width)

    def crop(self, length: int) -> None:
        self.length = length


class OracleDrafter:
    """TEST DOUBLE, not a real drafter: proposes the known greedy continuation ``reference``
    (the tokens at absolute positions prompt_len, prompt_len+1, ...), with top-1 WRONG and the right
    token at rank 2 at every ``wrong_every``-th position; elsewhere the right token at rank 1 and a
    decoy at rank 2. Checks the engine's context bookkeeping (ctx rows fill [cache.length, start_pos))
    and records the features (``cache.feats``)."""

    def __init__(self, prompt_len, reference, *, vocab, hidden, layer_ids, block_size=16, wrong_every=4):
        self.config = SimpleNamespace(block_size=block_size, target_layer_ids=list(layer_ids))
        self.prompt_len, self.reference, self.vocab = prompt_len, list(reference), vocab
        self.wrong_every, self.width = wrong_every, len(layer_ids) * hidden
        self.calls = 0

    def new_cache(self, max_len):
        return DoubleCache(max_len, self.width)

    def propose(self, cache, ctx, bonus_token, start_pos):
        assert cache.length + ctx.shape[0] == start_pos and ctx.shape[1] == self.width
        cache.feats[cache.length:start_pos] = ctx.float()
        cache.length = start_pos
        self.calls += 1
        logits = torch.zeros(self.config.block_size - 1, self.vocab)
        for j in range(1, self.config.block_size):
            idx = start_pos + j - self.prompt_len
            if not 0 <= idx < len(self.reference):
                logits[j - 1, 0] = 20.0
                continue
            right = self.reference[idx]
            if self.wrong_every and idx % self.wrong_every == self.wrong_every - 1:
                logits[j - 1, (right + 1) % self.vocab] = 21.0
                logits[j - 1, right] = 20.6
            else:
                logits[j - 1, right] = 20.0
                logits[j - 1, (right + 7) % self.vocab] = 17.0
        return logits


class TableDrafter(OracleDrafter):
    """TEST DOUBLE: fixed draft rows, ``rows[d]`` = tokens for depth d+1 in rank order."""

    def __init__(self, rows, *, vocab, hidden, layer_ids, block_size=4):
        super().__init__(0, [], vocab=vocab, hidden=hidden, layer_ids=layer_ids, block_size=block_size)
        self.rows = rows

    def propose(self, cache, ctx, bonus_token, start_pos):
        assert cache.length + ctx.shape[0] == start_pos
        cache.length = start_pos
        self.calls += 1
        logits = torch.zeros(self.config.block_size - 1, self.vocab)
        for d, row in enumerate(self.rows):
            for rank, tok in enumerate(row):
                logits[d, tok] = 20.0 - rank
        return logits
