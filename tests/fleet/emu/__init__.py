"""Emulations of the container tools that cannot run here: systemctl, journalctl, nvidia-smi.

The executables `tests/fleet/{systemctl,journalctl,nvidia-smi}` are thin wrappers around the modules
of this package (standard library only, Python >= 3.10): they are bind-mounted over
`/usr/bin/{systemctl,journalctl,nvidia-smi}` inside each test container's mount namespace, and they
also run standalone with `DDT_EMU_ROOT=<dir>` pointing at a fake root (see `paths.py`).
"""
