"""Speculative decoding core: best-first draft tree (tree.py), acceptance walk (walk.py), batched device tree build (tree_gpu.py) and walk (walk_gpu.py)."""
