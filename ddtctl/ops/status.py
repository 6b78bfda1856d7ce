"""Status of many hosts at once: unit state, readiness, models, GPUs, metrics, deployed version.

Hosts are queried in a thread pool (`parallel` workers); each part of each host is guarded so one
unreachable host or one failing probe never hides the others. Metrics come from `/metrics`
(Prometheus text, parsed with prometheus_client.parser): the bundled server's monotonic counters
when it exports them (tokens/s = `ddtree_decode_tokens_total` / `ddtree_decode_seconds_total`,
tau = `ddtree_decode_tokens_total` / `ddtree_decode_rounds_total`: aggregated over all decoding,
so 1-token readiness probes do not skew them), else its
`ddtree_acceptance_length` / `ddtree_decode_tokens_per_second` histograms (mean = sum / count),
SGLang's `sglang:spec_accept_length` / `sglang:gen_throughput` gauges, and vLLM's accepted/draft
token counters (1 + accepted / drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ddtctl.errors import UnreachableError
from ddtctl.inventory import Host
from ddtctl.ops import gpu as gpu_ops
from ddtctl.ops import releases
from ddtctl.ops.readiness import api_client, health_path
from ddtctl.ops.supervisor import manager_for


@dataclass
class HostStatus:
    host: str
    kind: str
    unit: dict | None = None
    ready: bool | None = None
    ready_detail: str = ""
    ready_state: str | None = None  # the bundled server's /ready `state` (loading, warming, ready, ...)
    models: list[str] = field(default_factory=list)
    gpus: list[dict] | None = None
    gpu_error: dict | None = None
    acceptance_length: float | None = None
    tokens_per_second: float | None = None
    release: str | None = None
    expected_release: str | None = None
    errors: list[str] = field(default_factory=list)
    unreachable: bool = False   # the host (its node) could not be connected to: exit 3

    @property
    def version_mismatch(self) -> bool:
        return bool(self.expected_release and self.release and self.release != self.expected_release)

    @property
    def stopped(self) -> bool:
        """The unit is down by intent (`inactive`, e.g. after `ddtctl stop`), not `failed`: not ready
        and not ok, but shown as `stopped` rather than as a readiness failure."""
        return bool(self.unit) and self.unit.get("active") == "inactive" and not self.unit.get("failed")

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.ready)

    def to_dict(self) -> dict:
        return {**self.__dict__, "version_mismatch": self.version_mismatch, "stopped": self.stopped,
                "ok": self.ok}


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


def _guard(st: HostStatus, part: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except UnreachableError as exc:  # report the connection error itself, once
        st.unreachable = True
        st.errors.append(f"{part}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    except Exception as exc:  # noqa: BLE001 - one failing probe must not hide the rest
        st.errors.append(f"{part}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def host_status(host: Host, transport, *, expected_release: str | None = None, gpus: bool = True) -> HostStatus:
    """Everything `status` shows for one host (never raises)."""
    st = HostStatus(host.name, host.service.kind, expected_release=expected_release)
    manager = manager_for(host, transport)

    def unit() -> None:
        st.unit = manager.state().to_dict()

    def http() -> None:
        with api_client(host, transport, timeout=30.0) as client:
            r = client.get(health_path(host))
            st.ready, st.ready_detail = r.status_code == 200, f"{health_path(host)} {r.status_code}"
            st.ready_state = _state_of(r)
            if st.ready_state and not st.ready:
                st.ready_detail += f" state={st.ready_state}"
            r = client.get("/v1/models")
            if r.status_code == 200:
                st.models = [m.get("id") for m in r.json().get("data", [])]
            r = client.get("/metrics")
            if r.status_code == 200:
                st.acceptance_length, st.tokens_per_second = parse_metrics(r.text)

    def gpu() -> None:
        res = transport.run(gpu_ops.QUERY_ARGV, timeout=60)
        got = gpu_ops.read_gpus(res.exit_code, res.text, res.err_text)
        if isinstance(got, gpu_ops.GpuError):
            st.gpu_error = got.to_dict()
        else:
            st.gpus = [g.to_dict() for g in gpu_ops.select_gpus(got, host.service.gpus)]

    def release() -> None:
        st.release = releases.read_link(transport, releases.Layout(host.root, host.unit).current)

    _guard(st, "unit", unit)
    if st.unreachable:  # nothing else can be asked; do not wait on HTTP/GPU/release timeouts
        st.ready, st.ready_detail = False, "unreachable"
        return st
    if st.unit and st.unit["active"] in ("inactive", "failed"):
        st.ready, st.ready_detail = False, f"service {st.unit['active']}"
    else:
        _guard(st, "http", http)
    if st.ready is None:
        st.ready, st.ready_detail = False, "unreachable"
    if gpus and (host.kind != "local" or host.service.gpus or getattr(host.service, "device", None) == "cuda"):
        _guard(st, "gpu", gpu)
    if host.service.kind == "ddtree":
        _guard(st, "release", release)
    return st


def gather(hosts: list[Host], transport_for: Callable[[Host], object], *, parallel: int = 8,
           expected_release: str | None = None, gpus: bool = True) -> list[HostStatus]:
    """Status of every host, in inventory order, `parallel` hosts at a time."""
    def one(host: Host) -> HostStatus:
        try:
            transport = transport_for(host)
        except Exception as exc:  # noqa: BLE001 - unreachable host: report, continue with the others
            return HostStatus(host.name, host.service.kind, ready=False, ready_detail="unreachable",
                              errors=[f"connect: {exc}"], unreachable=isinstance(exc, UnreachableError))
        try:
            return host_status(host, transport, expected_release=expected_release, gpus=gpus)
        finally:
            transport.close()

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, hosts))
