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

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ddtctl.errors import AuthError, UnreachableError
from ddtctl.inventory import Host
from ddtctl.ops import container as container_ops
from ddtctl.ops import gpu as gpu_ops
from ddtctl.ops import logcause, releases
from ddtctl.ops import router as router_ops
from ddtctl.ops.container import ContainerState
from ddtctl.ops.readiness import AUTH_CODES, api_client, auth_error, health_path
from ddtctl.ops.status_reads import prefetch_reads
from ddtctl.ops.supervisor import manager_for
from ddtctl.ops.verdict import (
    DEVICES_ARGV,
    HostStatus,
    missing_devices,
    parse_devices,
    needs_devices,
    unreachable_cause,
)


def _samples(text: str) -> dict[str, float]:
    """{sample name: value} for unlabelled samples plus label-summed totals (pure)."""
    from prometheus_client.parser import text_string_to_metric_families   # only when /metrics answered

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
    with contextlib.suppress(Exception):            # an unusable ssh config: the inventory's values
        cfg = node.config() if node is not None else None
        if cfg is not None:
            return f"{cfg.hostname}:{cfg.port}"
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
    st = HostStatus(host.name, host.service.kind,
                    expected_release=expected_release if host.service.kind == "ddtree" else None)
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
            if host.service.kind == "router":              # models and health live on its backends
                verdicts = router_ops.workers(client, host)
                st.backends = [{**b, "router": verdicts.get(b["name"])}
                               for b in router_ops.backend_states(host, transport)]
                st.models = [host.model_id] if any(b["ready"] for b in st.backends) else []
                return
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
        names = parse_devices(res.text)
        st.devices = {"present": [f"/dev/{n}" for n in names],
                      "missing": missing_devices(names, [str(g) for g in host.service.gpus])}

    def release() -> None:
        st.release = releases.read_link(transport, releases.Layout(host.root, host.unit).current)

    _guard(st, "container", container, timeout)
    if st.unreachable and host.node is not None:
        st.errors[-1] += f" (node {host.node_name} at {node_endpoint(host, transport)})"
    if host.kind == "container" and not st.unreachable and (st.container or {}).get("state") == "running":
        transport = prefetch_reads(host, transport, gpus)     # one pct exec for the reads below
        manager = manager_for(host, transport)
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
    if host.service.kind in ("ddtree", "router") and (st.container is None or st.container["state"] == "running"):
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
