"""HostStatus: what `status` found on one host and its verdict with the cause (pure bookkeeping).

The verdict is the `ready` column of `ddtctl status` and `verdict`/`cause` in its JSON: ok,
unreachable, container stopped / missing / error, no pct, auth failed, not installed (systemd:
LoadState=not-found), stopped (on purpose), stalled / unhealthy (`/health` is not 200: the
liveness probe), no GPU device (a CUDA service's /dev/nvidia* nodes missing in the container),
loading / warming, error (a probe failed while the service answered ready), failed. Device
names a CUDA process opens: the control device `nvidiactl`, one `nvidiaN` per GPU and
`nvidia-uvm` (unified memory), without which CUDA cannot initialise although nvidia-smi works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ddtctl.inventory import Host
from ddtctl.ops import releases


@dataclass
class HostStatus:
    host: str
    kind: str
    unit: dict | None = None
    ready: bool | None = None
    ready_detail: str = ""
    ready_state: str | None = None  # the bundled server's /ready `state` (loading, warming, ready, ...)
    live: bool | None = None        # liveness: GET /health == 200 (None: not asked)
    live_detail: str = ""           # e.g. "/health 503: stalled: the engine round in progress has run 301 s"
    devices: dict | None = None     # CUDA services in containers: {"present": [...], "missing": [...]}
    models: list[str] = field(default_factory=list)
    gpus: list[dict] | None = None
    gpu_error: dict | None = None
    acceptance_length: float | None = None
    tokens_per_second: float | None = None
    release: str | None = None
    expected_release: str | None = None
    errors: list[str] = field(default_factory=list)
    unreachable: bool = False   # the host (its node) could not be connected to: exit 3
    unreachable_cause: str = ""  # e.g. "no SSH banner in 10 s", "connection refused"
    container: dict | None = None  # container hosts: {"state": running|stopped|absent|no-pct|error, "detail"}
    auth_failed: bool = False   # the API answered 401/403: exit 3

    @property
    def version_mismatch(self) -> bool:
        return bool(self.expected_release and self.release
                    and releases.build_of(self.release) != self.expected_release)

    @property
    def stopped(self) -> bool:
        """The unit is down by intent (`inactive`, e.g. after `ddtctl stop`), not `failed`: not ready
        and not ok, but shown as `stopped` rather than as a readiness failure."""
        return bool(self.unit) and self.unit.get("active") == "inactive" and not self.unit.get("failed")

    @property
    def not_installed(self) -> bool:
        """systemd does not know the unit (LoadState=not-found) / no supervisor spec: never deployed."""
        return bool(self.unit) and self.unit.get("installed") is False

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.ready) and not self.unreachable and not self.auth_failed \
            and self.live is not False and not (self.devices or {}).get("missing") \
            and (self.container is None or self.container["state"] == "running")

    @property
    def verdict(self) -> str:
        """One word or two for the table: ok | unreachable | container stopped | container missing |
        no pct | auth failed | stopped | loading | warming | failed."""
        if self.ok:
            return "ok"
        if self.unreachable:
            return "unreachable"
        state = (self.container or {}).get("state", "running")
        if state != "running":
            return {"stopped": "container stopped", "absent": "container missing", "no-pct": "no pct"}.get(
                state, "container error")
        if self.auth_failed:
            return "auth failed"
        if self.not_installed:
            return "not installed"
        if self.stopped:
            return "stopped"
        if self.live is False:
            return "stalled" if "stalled" in self.live_detail else "unhealthy"
        if (self.devices or {}).get("missing"):
            return "no GPU device"
        if self.ready and self.errors:
            return "error"
        return self.ready_state if self.ready_state in ("loading", "warming") else "failed"

    @property
    def cause(self) -> str:
        """Why the verdict is not ok, in one line ("" when ok or nothing more is known)."""
        if self.ok:
            return ""
        if self.unreachable:
            return self.unreachable_cause
        if self.container and self.container["state"] != "running":
            return self.container["detail"]
        if self.auth_failed:
            return next(e for e in self.errors if "authentication failed" in e).split(": ", 1)[-1]
        if self.not_installed or self.stopped:
            return self.ready_detail
        if self.live is False:
            return self.live_detail
        if (self.devices or {}).get("missing"):
            return devices_cause(self.devices["missing"])
        if self.errors:
            return self.errors[0]
        return self.ready_detail

    def to_dict(self) -> dict:
        return {**self.__dict__, "version_mismatch": self.version_mismatch, "stopped": self.stopped,
                "not_installed": self.not_installed,
                "verdict": self.verdict, "cause": self.cause, "ok": self.ok}


# Device nodes a CUDA process opens (NVIDIA driver README, "Installing the NVIDIA Driver" / the
# nvidia-modprobe device files): the control device, one node per GPU, and the unified-memory
# device without which cuInit fails (CUDA_ERROR_UNKNOWN) although nvidia-smi works.
# `%Y` stats each entry (following links): `-type c` would trust the directory entry's type, and a
# device bound over a `create=file` mount point (lxc.mount.entry) is listed as a regular file there
DEVICES_ARGV = ["find", "/dev", "-maxdepth", "1", "-name", "nvidia*", "-printf", "%Y %f\\n"]


def parse_devices(find_output: str) -> list[str]:
    """Names of the character devices in `DEVICES_ARGV` output (pure)."""
    return sorted(name for kind, _, name in (line.partition(" ") for line in find_output.splitlines())
                  if kind == "c" and name)


def needs_devices(host: Host) -> bool:
    """A container service that uses CUDA: `gpus` set or `device: cuda`."""
    return host.kind == "container" and bool(host.service.gpus or getattr(host.service, "device", None) == "cuda")


def required_devices(gpus: list[str]) -> list[str]:
    """/dev names a CUDA service needs: nvidiactl, nvidia-uvm, and nvidiaN for each numeric GPU
    index (`nvidia[0-9]` stands for "at least one GPU" when none is numbered, e.g. MIG UUIDs)."""
    nums = [g for g in gpus if str(g).isdigit()]
    return ["nvidiactl", "nvidia-uvm"] + ([f"nvidia{g}" for g in nums] if nums else ["nvidia[0-9]"])


def missing_devices(found: list[str], gpus: list[str]) -> list[str]:
    """Required device names (required_devices) that are not among the character devices found."""
    have = set(found)
    any_gpu = any(n[len("nvidia"):].isdigit() for n in have)
    return [f"/dev/{n}" for n in required_devices(gpus)
            if not (n in have or (n == "nvidia[0-9]" and any_gpu))]


def devices_cause(missing: list[str]) -> str:
    return (f"{', '.join(missing)} missing in the container: CUDA cannot start there (add the node's "
            "device with lxc.mount.entry and lxc.cgroup2.devices.allow; the nvidia-uvm device appears on the "
            "node only after `nvidia-modprobe -u -c=0` or a first CUDA program)")


def unreachable_cause(message: str, connect_timeout: float | None = None) -> str:
    """The cause of a connection failure in words, from an UnreachableError's message: "no SSH
    banner in 10 s", "connection refused", "no answer in 10 s", "cannot resolve the name", ...
    (paramiko's own wording otherwise, without its exception class)."""
    low = message.lower()
    if connect_timeout is None:  # the transport names its deadline: "unreachable (no answer in 10 s)"
        said = re.search(r"no answer in ([0-9.]+) s", low)
        connect_timeout = float(said.group(1)) if said else None
    secs = f" in {connect_timeout:g} s" if connect_timeout else ""
    for needles, cause in ((("error reading ssh protocol banner",), f"no SSH banner{secs}"),
                           (("no existing session", "no ssh handshake from"), f"SSH handshake not completed{secs}"),
                           (("connection refused", "unable to connect to port"), "connection refused"),
                           (("no route to host",), "no route to host"),
                           (("network is unreachable",), "network unreachable"),
                           (("timed out", "timeouterror", "timeout"), f"no answer{secs}"),
                           (("cannot resolve", "name or service not known"), "cannot resolve the name"),
                           (("authentication failed",), "SSH authentication failed"),
                           (("host key",), "host key not accepted")):
        if any(n in low for n in needles):
            return cause
    text = message.strip().splitlines()[0] if message.strip() else "cannot connect"
    return text.rsplit(": ", 1)[-1]
