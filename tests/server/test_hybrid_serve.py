"""End-to-end: the real `ddtree-server serve` process on a tiny Qwen3.5-style hybrid folder (text-only
and multimodal layouts, written by the test) with a scaled-down z-lab Qwen3.6 drafter folder,
queried with the official `openai` client: DDTree is served and equals plain decoding."""

from __future__ import annotations

import openai
import pytest
import torch

from ddtree_server.models.drafter.model import DFlashDrafter
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.drafter.load import save_drafter
from tests.server.drafter_fixtures import qwen36_drafter_config, randomize
from tests.server.hybrid_folders import SPECIALS, WORDS, write_hybrid_folder
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.slow
VOCAB = len(SPECIALS) + len(WORDS)


@pytest.fixture(scope="module", params=["text", "multimodal"])
def server(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    target = write_hybrid_folder(root / "target", multimodal=request.param == "multimodal", seed=51,
                                 pattern="qwen3.6x2", vocab=VOCAB)
    emb, head = torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB, bias=False)
    raw = qwen36_drafter_config(vocab=VOCAB, mask=SPECIALS.index("<mask>"))
    drafter = save_drafter(randomize(DFlashDrafter(DrafterConfig.from_dict(raw), emb, head), seed=4, scale=0.1),
                           root / "drafter", dtype=torch.float32)
    proc = ServerProcess("--target", str(target), "--drafter", str(drafter), "--max-model-len", "256",
                         "--served-model-name", "hybrid-test", ready_timeout=300)
    proc.start()
    yield proc
    proc.stop()


def test_serves_ddtree_equal_to_plain_decoding(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    assert [m.id for m in client.models.list().data] == ["hybrid-test"]
    kwargs = dict(model="hybrid-test", prompt="the cat sat on the mat and", max_tokens=24, temperature=0)
    texts = {}
    for mode in ("ar", "dflash", "ddtree"):
        resp = client.completions.create(**kwargs, extra_body={"decoding": {"mode": mode}, "ignore_eos": True})
        stats = resp.model_extra["decoding"]
        assert stats["mode"] == mode and stats["generated_tokens"] == 24
        texts[mode] = resp.choices[0].text
    assert texts["dflash"] == texts["ar"] == texts["ddtree"] and texts["ar"]
    default = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).model_extra["decoding"]
    assert default["mode"] == "ddtree" and default["tree_budget"] == 15 and default["block_size"] == 16
    chat = client.chat.completions.create(model="hybrid-test", messages=[{"role": "user", "content": "why is the sky blue"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.content is not None
    log = server.log_text()
    assert "hybrid Gated DeltaNet + gated attention" in log and "tree mode available" in log
