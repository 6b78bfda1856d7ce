"""Models by family: dense/ (TargetModel), hybrid/ (HybridTarget), drafter/ (DFlashDrafter); shared
layer pieces in layers.py, loader commons in common.py, the family table in families.py."""
