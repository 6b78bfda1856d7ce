"""Status of many hosts at once: unit state, readiness, models, GPUs, metrics, deployed version.

Hosts are queried in a thread pool (`parallel` workers); each part of each host is guarded so one
unreachable host or one failing probe never hides the others. A container host is first looked
up with `pct status` on its node (ops/container.py): a stopped container is "container stopped",
one that is not where the inventory says (wrong vmid, another node, no pct) is an error, and
neither is ever `ok`; pct's failures are never filed as unit or GPU errors. An unreachable node
is "unreachable" with the cause in words; an API answering 401/403 is "auth failed" (exit 3).
HostStatus.verdict / .cause are what the table shows. Metrics come from `/metrics`
(Prometheus text, parsed with prometheus_client.parser): the bundled server's monotonic counters
when it exports them (tokens/s = `ddtree_decode_tokens_total` / `ddtree_decode_seconds_total`,
tau = `ddtree_decode_tokens_total` / `ddtree_decode_rounds_total`: aggregated over all decoding,
so 1-token readiness probes do not skew them), else its
`ddtree_acceptance_length` / `ddtree_decode_tokens_per_second` histograms (mean = sum / count),
SGLang's `sglang:spec_accept_length` / `sglang:gen_throughput` gauges, and vLLM's accepted/draft
token counters (1 + accepted / drafts).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ddtctl.errors import AuthError, UnreachableError
from ddtctl.inventory import Host
from ddtctl.ops import container as container_ops
from ddtctl.ops import gpu as gpu_ops
from ddtctl.ops import logcause, releases
from ddtctl.ops.container import ContainerState
from ddtctl.ops.readiness import AUTH_CODES, api_client, auth_error, health_path
from ddtctl.ops.supervisor import manager_for


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
DEVICES_ARGV = ["find", "/dev", "-maxdepth", "1", "-name", "nvidia*", "-type", "c", "-printf", "%f\\n"]


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


def _samples(text: str) -> dict[str, float]:
    """{sample name: value} for unlabelled samples plus label-summed totals (pure)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(mean acceptance length, tokens/s) from Prometheus text; None where not reported."""
    s = _samples(text)

    def mean(name: str) -> float | None:
        count = s.get(f"{name}_count")
        return s[f"{name}_sum"] / count if count else None

    def ratio(num: str, den: str) -> float | None:
        top, bottom = s.get(num), s.get(den)
        return top / bottom if top is not None and bottom else None

    accept = (ratio("ddtree_decode_tokens_total", "ddtree_decode_rounds_total")
              or mean("ddtree_acceptance_length") or s.get("sglang:spec_accept_length"))
    tps = (ratio("ddtree_decode_tokens_total", "ddtree_decode_seconds_total")
           or mean("ddtree_decode_tokens_per_second") or s.get("sglang:gen_throughput"))
    drafts = s.get("vllm:spec_decode_num_drafts_total")
    if accept is None and drafts:
        accept = 1.0 + s.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafts
    return accept, tps


def _state_of(resp) -> str | None:
    """`state` of a JSON health body ({"state": "loading", ...}), else None."""
    try:
        body = resp.json()
    except ValueError:
        return None
    state = body.get("state") if isinstance(body, dict) else None
    return state if isinstance(state, str) else None


def node_endpoint(host: Host, transport) -> str:
    """`address:port` of a container's node as the SSH configuration resolves it (the inventory's
    port, else the ssh config's, else 22), never `None`."""
    node = getattr(transport, "node", None)
    try:
        cfg = node.config() if node is not None else None
        if cfg is not None:
            return f"{cfg.hostname}:{cfg.port}"
    except Exception:  # noqa: BLE001 - an unusable ssh config: fall back to the inventory
        pass
    return f"{host.node.address}:{host.node.port or 22}"


def _log_cause(st: HostStatus, manager) -> None:
    """Add the failed start's cause from the service log (ops/logcause.py) to `ready_detail`."""
    why = logcause.cause(logcause.last_start(manager.log_tail(80)))
    if why:
        st.ready_detail += f": {why}"


def _reason_of(resp) -> str:
    """Why a /health answer is not 200: the body's `reason` (the bundled server), else a short text."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("reason"):
        return str(body["reason"])[:200]
    from ddtctl.ops.readiness import brief_body
    return brief_body(resp)


def _guard(st: HostStatus, part: str, fn: Callable[[], None], connect_timeout: float | None = None) -> None:
    try:
        fn()
    except UnreachableError as exc:  # report the connection error itself, once
        st.unreachable = True
        st.unreachable_cause = st.unreachable_cause or unreachable_cause(str(exc), connect_timeout)
        st.errors.append(f"unreachable: {st.unreachable_cause}")
    except AuthError as exc:
        st.auth_failed = True
        st.errors.append(f"{part}: {str(exc).splitlines()[0].removeprefix(f'{st.host}: ')}")
    except Exception as exc:  # noqa: BLE001 - one failing probe must not hide the rest
        st.errors.append(f"{part}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def _container_problem(st: HostStatus, found: ContainerState) -> None:
    """Record a container that is not running where the inventory says (never filed elsewhere)."""
    st.container = found.to_dict()
    st.ready, st.ready_detail = False, found.detail
    if found.state != "stopped":                       # stopped is a state; the others are errors
        st.errors.append(f"container: {found.detail}")


def host_status(host: Host, transport, *, expected_release: str | None = None, gpus: bool = True) -> HostStatus:
    """Everything `status` shows for one host (never raises)."""
    st = HostStatus(host.name, host.service.kind, expected_release=expected_release)
    manager = manager_for(host, transport)
    timeout = getattr(getattr(transport, "node", transport), "connect_timeout", None)

    def container() -> None:
        found = container_ops.check(transport)
        if found.state != "n/a":
            st.container = found.to_dict()
            if not found.running:
                _container_problem(st, found)

    def unit() -> None:
        state = manager.diagnose()                      # a failed unit: also whether its start limit hit
        st.unit = state.to_dict()
        if state.active == "unknown":
            st.errors.append(f"unit: the state of {host.unit} could not be read")

    def http() -> None:
        with api_client(host, transport, timeout=30.0) as client:
            def get(path: str):
                r = client.get(path)
                if r.status_code in AUTH_CODES:              # an answer, not a state: not ok (exit 3)
                    raise auth_error(host, f"{path} {r.status_code}")
                return r

            r = get("/health")                           # liveness: a stalled engine answers 503
            st.live = r.status_code == 200
            st.live_detail = f"/health {r.status_code}" + ("" if st.live else f": {_reason_of(r)}")
            if health_path(host) != "/health":               # readiness of the bundled server
                r = get(health_path(host))
            st.ready, st.ready_detail = r.status_code == 200, f"{health_path(host)} {r.status_code}"
            st.ready_state = _state_of(r)
            if st.ready_state and not st.ready:
                st.ready_detail += f" state={st.ready_state}"
            r = get("/v1/models")
            if r.status_code == 200:
                st.models = [m.get("id") for m in r.json().get("data", [])]
            r = get("/metrics")
            if r.status_code == 200:
                st.acceptance_length, st.tokens_per_second = parse_metrics(r.text)

    def gpu() -> None:
        res = transport.run(gpu_ops.QUERY_ARGV, timeout=60)
        if res.exit_code == 2 and "mig.mode.current" in res.text:       # a driver without MIG fields
            res = transport.run(gpu_ops.LEGACY_QUERY_ARGV, timeout=60)
        found = container_ops.pct_failure(res.exit_code, res.err_text)
        if found is not None:                                # pct's failure, not the GPU's
            _container_problem(st, found)
            return
        got = gpu_ops.read_gpus(res.exit_code, res.text, res.err_text)
        if isinstance(got, gpu_ops.GpuError):
            st.gpu_error = got.to_dict()
        else:
            st.gpus = [g.to_dict() for g in gpu_ops.select_gpus(got, host.service.gpus)]

    def devices() -> None:
        res = transport.run(DEVICES_ARGV, timeout=60)
        found = container_ops.pct_failure(res.exit_code, res.err_text)
        if found is not None:
            _container_problem(st, found)
            return
        names = sorted(res.text.split())
        st.devices = {"present": [f"/dev/{n}" for n in names],
                      "missing": missing_devices(names, [str(g) for g in host.service.gpus])}

    def release() -> None:
        st.release = releases.read_link(transport, releases.Layout(host.root, host.unit).current)

    _guard(st, "container", container, timeout)
    if st.unreachable and host.node is not None:
        st.errors[-1] += f" (node {host.node_name} at {node_endpoint(host, transport)})"
    if not st.unreachable and (st.container is None or st.container["state"] == "running"):
        _guard(st, "unit", unit, timeout)
    if st.unreachable or (st.container and st.container["state"] != "running"):
        # nothing else can be asked; do not wait on HTTP/GPU/release timeouts
        st.ready, st.ready_detail = False, st.ready_detail if st.container else "unreachable"
        return st
    if st.unit and st.unit.get("installed") is False:
        st.ready, st.ready_detail = False, (f"{host.unit} is not installed (systemd: LoadState=not-found): "
                                            f"deploy it (ddtctl deploy {host.name})" if host.kind != "local" else
                                            f"no service installed: deploy it (ddtctl deploy {host.name})")
    elif st.unit and st.unit["active"] == "failed":
        st.ready, st.ready_detail = False, f"service {st.unit['description']}"
        _guard(st, "log", lambda: _log_cause(st, manager), timeout)
    elif st.unit and st.unit["active"] == "inactive":
        st.ready, st.ready_detail = False, f"service inactive: start it (ddtctl start {host.name})"
    else:
        _guard(st, "http", http, timeout)
    if st.ready is None:
        st.ready, st.ready_detail = False, "unreachable"
    if gpus and (host.kind != "local" or host.service.gpus or getattr(host.service, "device", None) == "cuda"):
        _guard(st, "gpu", gpu, timeout)
    if needs_devices(host) and (st.container is None or st.container["state"] == "running"):
        _guard(st, "devices", devices, timeout)
    if host.service.kind == "ddtree" and (st.container is None or st.container["state"] == "running"):
        _guard(st, "release", release, timeout)
    return st


def gather(hosts: list[Host], transport_for: Callable[[Host], object], *, parallel: int = 8,
           expected_release: str | None = None, gpus: bool = True) -> list[HostStatus]:
    """Status of every host, in inventory order, `parallel` hosts at a time."""
    def one(host: Host) -> HostStatus:
        try:
            transport = transport_for(host)
        except Exception as exc:  # noqa: BLE001 - unreachable host: report, continue with the others
            unreachable = isinstance(exc, UnreachableError)
            return HostStatus(host.name, host.service.kind, ready=False, ready_detail="unreachable",
                              errors=[f"connect: {exc}"], unreachable=unreachable,
                              unreachable_cause=unreachable_cause(str(exc)) if unreachable else "")
        try:
            return host_status(host, transport, expected_release=expected_release, gpus=gpus)
        finally:
            transport.close()

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, hosts))
