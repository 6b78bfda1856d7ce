"""The training step's parts: target features, the block loss (row sampling, per-position
acceptance), length-bucketed batches, and the training-log plot."""

from __future__ import annotations

import json

import pytest
import torch

from ddtree_server.train.data import Sequence
from ddtree_server.train.objective import block_loss, position_weights, stats_to_host


def test_features_stop_at_the_deepest_layer_and_equal_hidden_states():
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddtree_server.train.features import capture_features

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 50, (2, 9))
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, k=k: ran.append(k)) for k, layer in enumerate(model.model.layers)]
    got = capture_features(model, ids, [1, 3])
    for h in hooks:
        h.remove()
    assert ran == [0, 1, 2, 3]  # layers 4 and 5 never ran
    ref = model(input_ids=ids, output_hidden_states=True).hidden_states  # entry k+1 = output of layer k
    torch.testing.assert_close(got, torch.cat([ref[2], ref[4]], dim=-1))


class _Head(torch.nn.Module):
    """An LM head that reads one-hot rows: logits = hidden."""

    def forward(self, x):
        return x


def _blocks(correct_upto: int, bs: int = 5, vocab: int = 20):
    """One sequence of 12 tokens, anchors 0 and 4; rows 1..correct_upto of each block predict
    their label, the later rows predict a wrong token."""
    ids = torch.arange(12)[None] % vocab
    anchors, valid = torch.tensor([[0, 4]]), torch.ones((1, 2), dtype=torch.bool)
    hidden = torch.zeros((1, 2, bs, vocab))
    for i, a in enumerate([0, 4]):
        for k in range(1, bs):
            tok = int(ids[0, a + k]) if k <= correct_upto else (int(ids[0, a + k]) + 1) % vocab
            hidden[0, i, k, tok] = 10.0
    return hidden, ids, torch.tensor([12]), anchors, valid


@pytest.mark.parametrize("upto", [0, 2, 4])
def test_accept_per_position_and_tau(upto):
    hidden, ids, lens, anchors, valid = _blocks(upto)
    _, st = block_loss(hidden, ids, lens, anchors, valid, position_weights(5, 7.0), _Head())
    st = stats_to_host(st)
    assert st["accept"] == [1.0] * upto + [0.0] * (4 - upto)
    assert st["tau"] == 1 + upto
    assert st["acc"] == st["accept"]


def test_row_sampling_is_unbiased_and_cheaper():
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 16, 30, requires_grad=True)
    ids = torch.randint(0, 30, (2, 40))
    lens, valid = torch.tensor([40, 33]), torch.ones((2, 6), dtype=torch.bool)
    anchors = torch.tensor([[0, 3, 9, 15, 20, 25]] * 2)
    w = position_weights(16, 7.0)
    full, _ = block_loss(hidden, ids, lens, anchors, valid, w, _Head())
    draws = [block_loss(hidden, ids, lens, anchors, valid, w, _Head(), row_sample=torch.Generator().manual_seed(i))[0]
             for i in range(300)]
    mean = torch.stack([d.detach() for d in draws]).mean()
    assert float(mean) == pytest.approx(float(full.detach()), rel=0.03)
    draws[0].backward()
    assert hidden.grad is not None and float(hidden.grad.abs().sum()) > 0
    # rows kept: sum(w) / 15 of them on average (44% for gamma 7)
    assert float(w.sum() / w.numel()) == pytest.approx(0.442, abs=0.01)
    _, st = block_loss(hidden, ids, lens, anchors, valid, w, _Head(), row_sample=torch.Generator().manual_seed(0))
    assert stats_to_host(st)["tau"] is None  # chain statistics need every row


def _trainer(lengths, batch_size=4, bucket=8):
    from ddtree_server.train.trainer import Trainer, TrainSettings

    seqs = [Sequence(torch.zeros(n, dtype=torch.long), 1) for n in lengths]
    t = Trainer.__new__(Trainer)  # batch() needs only the sequences and the settings
    t.seqs, t.s = seqs, TrainSettings(steps=1, batch_size=batch_size, bucket=bucket, seed=3)
    return t


def test_bucketed_batches_cover_every_sequence_once_per_epoch_with_less_padding():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 500, (96,), generator=g).tolist()
    bucketed = _trainer(lengths)
    plain = _trainer(lengths, bucket=1)
    seen = [id(s) for step in range(24) for s in bucketed.batch(step)]
    assert sorted(seen) == sorted(id(s) for s in bucketed.seqs)  # 96 / 4 = 24 steps per epoch

    def padding(t):
        total = 0
        for step in range(24):
            ls = [len(s.ids) for s in t.batch(step)]
            total += max(ls) * len(ls) - sum(ls)
        return total

    assert padding(bucketed) < 0.3 * padding(plain)
    assert [id(s) for s in bucketed.batch(30)] == [id(s) for s in bucketed.batch(30)]  # deterministic
    assert [id(s) for s in bucketed.batch(0)] != [id(s) for s in bucketed.batch(24)]  # a new epoch reshuffles


def test_plot_makes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from ddtree_server.train.plot import main, read_log

    log = tmp_path / "train_log.jsonl"
    recs = [{"kind": "val", "run": 0, "phase": "start", "step": 0, "val_loss": 4.0, "val_tau": 2.0,
             "val_acc": [0.5] * 15, "val_accept": [0.5, 0.3] + [0.1] * 13}]
    recs += [{"kind": "train", "run": r, "step": s, "loss": 4 - s / 100, "tau": 2 + s / 100, "acc": [0.5] * 15}
             for r, s in [(0, 10), (0, 20), (1, 30), (1, 40)]]
    recs += [{"kind": "val", "run": 1, "phase": "end", "step": 40, "val_loss": 3.5, "val_tau": 2.6,
              "val_acc": [0.6] * 15, "val_accept": [0.6, 0.4] + [0.1] * 13}]
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    train, val = read_log([log])
    assert len(train) == 4 and len(val) == 2
    main([str(log), "--out", str(tmp_path / "p.png")])
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit, match="no training record"):
        main([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "q.png")])
