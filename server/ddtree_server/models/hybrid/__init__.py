"""Qwen3.5 / Qwen3.6 hybrid targets (Gated DeltaNet + gated attention) with tree verification.

config.py (HybridConfig), delta.py (gated delta rule: chunked, tree-masked, per-node, fold),
tree.py (per-forward tree metadata), gdn.py / layers.py (layers), cache.py (HybridCache),
model.py (HybridTarget), load.py (checkpoint folders), graphs.py (CUDA graphs). See docs/hybrid.md.
"""
