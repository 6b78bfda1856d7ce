"""Helpers of the ``tests/fleet/pct`` emulation of Proxmox ``pct`` (see that script's docstring).

getopt.py: Getopt::Long-style argv parsing (pure); state.py: the per-node state directory and
container configs; ns.py: container filesystem views (persistent mount namespaces) and copies
into/out of them.
"""
