"""The reads `status` makes inside one container, in one remote command.

On a Proxmox node each `pct exec` costs a pct (Perl) start and an lxc-attach; `status` reads the
unit state (`systemctl show`), the GPUs (`nvidia-smi`), the CUDA device nodes (`find /dev`) and,
for releases, the `current` link of every container. `prefetch_reads` runs them in one `pct exec` (remote/batch.py) and returns a
transport that answers those argvs from the batch; the status code runs unchanged on it, and any
other command (a journal read for a failed unit, the legacy nvidia-smi query) runs on its own.
"""

from __future__ import annotations

from ddtctl.inventory import Host
from ddtctl.ops import gpu as gpu_ops
from ddtctl.ops import releases
from ddtctl.ops.supervisor import show_argv
from ddtctl.ops.verdict import DEVICES_ARGV, needs_devices
from ddtctl.remote.batch import Prefetched, run_batch


def prefetch_reads(host: Host, transport, gpus: bool):
    """The transport with the unit state, GPU query and release link read in one remote command
    (remote/batch.py); unchanged when that batch cannot run (each read then runs on its own)."""
    argvs = [show_argv(host.unit)] + ([list(gpu_ops.QUERY_ARGV)] if gpus else [])
    if needs_devices(host):
        argvs.append(list(DEVICES_ARGV))
    if host.service.kind in ("ddtree", "router"):
        argvs.append(["readlink", releases.Layout(host.root, host.unit).current])
    try:
        return Prefetched(transport, run_batch(transport, argvs))
    except Exception:  # noqa: BLE001 - the reads themselves report what is wrong
        return transport
