"""Speculative decoding core: best-first draft tree (tree.py), acceptance walk (walk.py), device tree build (tree_gpu.py)."""
