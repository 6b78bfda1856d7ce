"""Batched static-cache answer generation (train/generate.py) against transformers' generate(), fp32 CPU."""

from __future__ import annotations

import pytest
import torch

from ddtree_server.train.generate import StaticGenerator, greedy_agreement, supports


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=1, pad_token_id=0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw, rope_theta=1e4)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=16)).eval()


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 96, (n,), generator=g).tolist() for n in (5, 11, 1, 8)]


def _hf_greedy(model, prompts, n):
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=[1])
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[:next((j + 1 for j, t in enumerate(row) if t == 1), len(row))])
    return rows


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_equals_generate_with_left_padding(kind):
    model = _model(kind)
    prompts = _prompts()
    assert supports(model)
    out, steps = StaticGenerator(model, [1]).generate(prompts, [False] * 4, max_new_tokens=24, pad_id=0)
    assert out == _hf_greedy(model, prompts, 24)
    assert steps <= 24
    assert greedy_agreement(model, prompts, out) == 1.0


def test_sampled_rows_are_seeded_and_leave_greedy_rows_alone():
    model = _model("llama")
    prompts = _prompts()
    gen = StaticGenerator(model, [1])
    greedy, _ = gen.generate(prompts, [False] * 4, max_new_tokens=16)
    mixed, _ = gen.generate(prompts, [False, True, False, True], max_new_tokens=16, temperature=1.0, seed=5)
    again, _ = gen.generate(prompts, [False, True, False, True], max_new_tokens=16, temperature=1.0, seed=5)
    other, _ = gen.generate(prompts, [False, True, False, True], max_new_tokens=16, temperature=1.0, seed=6)
    assert mixed == again and mixed != other
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]
    assert all(0 <= t < 96 for row in mixed for t in row)


def test_stops_once_every_row_has_stopped():
    model = _model("llama")
    every = list(range(96))  # every token stops: each row ends after its first token
    out, steps = StaticGenerator(model, every).generate(_prompts(), [False] * 4, max_new_tokens=200)
    assert [len(r) for r in out] == [1] * 4 and steps == 16  # "all stopped" is checked every 16 steps


def test_agreement_exposes_a_wrong_answer():
    model = _model("llama")
    prompts = _prompts()
    out, _ = StaticGenerator(model, [1]).generate(prompts, [False] * 4, max_new_tokens=12)
    wrong = [[(t + 1) % 96 for t in row] for row in out]
    assert greedy_agreement(model, prompts, wrong) == 0.0


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert not supports(model)
    with pytest.raises(ValueError, match="not supported"):
        StaticGenerator(model, [1])


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_answerer_falls_back_to_generate(fault, monkeypatch):
    from ddtree_server.train import generate as gen_mod
    from ddtree_server.train.answer import Answerer
    from ddtree_server.train.data import GenSettings

    model = _model("llama")
    prompts = _prompts()
    real = gen_mod.StaticGenerator.generate

    def broken(self, ps, sampled, **kw):
        if fault == "raises":
            raise RuntimeError("no kernel for this device")
        out, steps = real(self, ps, sampled, **kw)
        return [[(t + 1) % 96 for t in row] for row in out], steps

    monkeypatch.setattr(gen_mod.StaticGenerator, "generate", broken)
    events = []
    answer = Answerer(model, GenSettings(max_new_tokens=16), 0, [1], lambda kind, rec: events.append(rec))
    out = answer(prompts, [False] * 4, seed=0)
    assert answer.engine == "hf" and out == _hf_greedy(model, prompts, 16)
    assert any(e.get("stage") == "generate() fallback" for e in events)


def test_answerer_checks_greedy_even_when_the_batch_samples(monkeypatch):
    from ddtree_server.train.answer import Answerer
    from ddtree_server.train.data import GenSettings

    events = []
    answer = Answerer(_model("llama"), GenSettings(max_new_tokens=8), 0, [1], lambda kind, rec: events.append(rec))
    answer(_prompts(), [True] * 4, seed=0)
    assert answer.engine == "static"
    assert [e["greedy_agreement"] for e in events if e.get("stage") == "static generator check"] == [1.0]


def test_answerer_halves_a_batch_that_runs_out_of_memory(monkeypatch):
    from ddtree_server.train import generate as gen_mod
    from ddtree_server.train.answer import Answerer
    from ddtree_server.train.data import GenSettings

    model = _model("llama")
    prompts = _prompts()
    real = gen_mod.StaticGenerator.generate
    sizes = []

    def small_memory(self, ps, sampled, **kw):
        sizes.append(len(ps))
        if len(ps) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (emulated)")
        return real(self, ps, sampled, **kw)

    monkeypatch.setattr(gen_mod.StaticGenerator, "generate", small_memory)
    answer = Answerer(model, GenSettings(max_new_tokens=16), 0, [1], lambda kind, rec: None)
    out = answer(prompts, [False] * 4, seed=0)
    assert answer.engine == "static" and out == _hf_greedy(model, prompts, 16)
    assert sizes[:3] == [4, 2, 2]


@pytest.mark.slow
def test_real_smollm2_answers_equal_generate(smollm2, smollm2_hf):
    """The default target (fp32 CPU): two chat prompts of different lengths, greedy, 24 tokens."""
    tok = smollm2.tokenizer
    texts = ["What is 2+2?", "Write a haiku about autumn leaves falling in a quiet forest at dusk."]
    prompts = []
    for t in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    eos = [tok.eos_token_id]
    width = max(map(len, prompts))
    ids = torch.full((2, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    ref = smollm2_hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              pad_token_id=tok.pad_token_id, eos_token_id=eos)
    want = []
    for row in ref[:, width:].tolist():
        want.append(row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))])
    got, _ = StaticGenerator(smollm2_hf, eos).generate(prompts, [False, False], max_new_tokens=24,
                                                      pad_id=tok.pad_token_id)
    assert got == want and len(got[1]) == 24
