"""Dense Llama-family targets (llama, mistral, qwen2, qwen3): target.py (TargetModel), fast.py (its
Triton-kernel path), graphs.py (CUDA-graph replay), load.py (HF folders). See docs/server.md."""
