"""The GDN tree-verify microbenchmark runs (CPU smoke run of the GPU benchmark's code) and its
memory formula matches the bytes a HybridCache really allocates."""

from __future__ import annotations

import torch

from ddtree_server.bench.hybrid_verify import measure, state_memory
from ddtree_server.models.hybrid.config import HybridConfig
from ddtree_server.models.hybrid.model import HybridTarget
from tests.server.hybrid_fixtures import tiny_config


def test_benchmark_smoke_on_cpu():
    torch.set_num_threads(1)
    raw = tiny_config("3gdn+attn").to_dict()
    report = measure(raw, [5, 9], context=16, dtype="fp32", device="cpu", iters=5)
    for method in ("chunk", "node"):
        for n in ("5", "9"):
            assert report["per_layer"][method][n]["mixer_ms"] > 0 and report["per_layer"][method][n]["rule_ms"] > 0
            v = report["verify"][method][n]
            assert v["verify_ms"] > 0 and v["round_ms"] > 0 and v["path_len"] >= 2
        assert report["verify"][method]["plain_step_ms"] > 0 and report["verify"][method]["dflash_verify_ms"] > 0
    assert report["faster_round_at_9"] in ("chunk", "node")


def test_memory_formula_matches_allocation():
    cfg = HybridConfig.from_any(tiny_config("mixed6").to_dict())
    mem = state_memory(cfg, tree_rows=80)
    for method in ("chunk", "node"):
        with torch.device("meta"):
            model = HybridTarget(cfg, method)
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        cache = model.new_cache(8, tree_rows=80)
        win = cache.win.numel() * cache.win.element_size()
        assert cache.state_bytes() - win == mem["static_per_request_bytes"][method]


def test_benchmark_kernel_settings_section_on_cpu():
    """--kernels on,off adds per-setting layer / verify figures, the decode-step mixer and a summary
    (on CPU without the Triton interpreter both settings run the torch path: a smoke run)."""
    torch.set_num_threads(1)
    raw = tiny_config("3gdn+attn").to_dict()
    report = measure(raw, [5], context=8, dtype="fp32", device="cpu", iters=5, methods=("chunk",),
                     settings=("on", "off"))
    kern = report["kernels"]
    assert set(kern["per_layer"]) == set(kern["verify"]) == {"on", "off"}
    for st in ("on", "off"):
        assert set(kern["per_layer"][st]) == {"1", "5"} and kern["per_layer"][st]["1"]["mixer_ms"] > 0
        assert kern["summary"][st]["verify_over_plain"] > 0
    assert kern["per_layer"]["off"] is report["per_layer"]["chunk"] and kern["failed"] == []
