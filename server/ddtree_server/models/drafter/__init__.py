"""The z-lab DFlash drafter: config.py (DrafterConfig), attention.py (layer attention layout),
layers.py, model.py (DFlashDrafter + DraftCache), load.py (z-lab folders), graphs.py (CUDA graphs),
fast.py (Triton-kernel path). See docs/ddtree.md §1."""
