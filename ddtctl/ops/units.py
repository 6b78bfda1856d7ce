"""Service specs (argv + environment) and their rendering as systemd units and EnvironmentFiles.

`service_spec(host)` is pure: the exact argv and environment of the bundled server, SGLang or
vLLM. `render_unit` / `render_env` turn a spec into file text with Jinja2 (StrictUndefined) and
escaping filters that follow systemd.service(5) "Command lines", systemd.exec(5) `Environment=`
and `EnvironmentFile=`, and systemd.unit(5) specifiers (docs/operations.md §5, §13.5): every
value is escaped, so `%s`, `100%FREE`, `$HOME`, quotes and spaces reach the process unchanged.
The local supervisor runs the same spec without systemd (`render_local`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ddtctl.inventory import Host
from ddtctl.ops.releases import Layout

if TYPE_CHECKING:   # jinja2 comes with the first systemd unit rendered (deploy, render); status, logs and
    # local hosts (a JSON spec) never need it
    import jinja2

FIXED_ENV = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


@dataclass(frozen=True)
class ServiceSpec:
    """What runs: argv, fixed environment (unit `Environment=`), user environment (EnvironmentFile)."""

    unit: str
    kind: str
    description: str
    argv: list[str]
    environment: dict[str, str]
    env_file: str
    env_file_vars: dict[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    notify: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def service_spec(host: Host) -> ServiceSpec:
    """The service of `host` as argv + environment (pure; all paths are paths on the target)."""
    svc = host.service
    layout = Layout(host.root, host.unit)
    env = dict(FIXED_ENV)
    if svc.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(svc.gpus)
    common = ["--host", host.bind, "--port", str(svc.port), "--served-model-name", host.model_id]
    if svc.kind == "ddtree":
        argv = [layout.server_bin, "serve", *common]
        if svc.target is not None:
            argv += ["--gguf" if svc.target.path.endswith(".gguf") else "--target", svc.target.path]
        if svc.drafter is not None:
            argv += ["--drafter", svc.drafter.path]
        for flag, value in (("--mode", svc.mode), ("--tree-budget", svc.tree_budget),
                            ("--device", svc.device), ("--dtype", svc.dtype)):
            if value is not None:
                argv += [flag, str(value)]
        desc = f"ddtree-server ({host.model_id}) for ddtctl host {host.name}"
    elif svc.kind == "sglang":
        argv = [svc.python, "-m", "sglang.launch_server", "--model-path", svc.target.path, *common]
        if svc.tp_size is not None:
            argv += ["--tp-size", str(svc.tp_size)]
        if svc.drafter is not None:
            argv += ["--speculative-algorithm", svc.speculative_algorithm,
                     "--speculative-draft-model-path", svc.drafter.path]
            if svc.block_size is not None:
                argv += ["--speculative-num-draft-tokens", str(svc.block_size)]
        if svc.mamba_scheduler_strategy is not None:
            argv += ["--mamba-scheduler-strategy", svc.mamba_scheduler_strategy]
        desc = f"SGLang ({host.model_id}) for ddtctl host {host.name}"
    elif svc.kind == "vllm":
        argv = [svc.executable, "serve", svc.target.path, *common]
        if svc.tp_size is not None:
            argv += ["--tensor-parallel-size", str(svc.tp_size)]
        if svc.drafter is not None:
            conf = {**svc.speculative_config, "model": svc.drafter.path}
            if svc.block_size is not None:            # a DFlash block = the bonus token + the drafted ones
                conf["num_speculative_tokens"] = svc.block_size - 1
            argv += ["--speculative-config", json.dumps(conf, separators=(",", ":"), sort_keys=True)]
        desc = f"vLLM ({host.model_id}) for ddtctl host {host.name}"
    else:
        argv = router_argv(host, layout)
        desc = f"sglang-router ({host.model_id}, {len(host.backends)} backends) for ddtctl host {host.name}"
    return ServiceSpec(unit=host.unit, kind=svc.kind, description=desc, argv=[*argv, *svc.extra_args],
                       environment=env, env_file=layout.env_file, env_file_vars=dict(svc.environment),
                       working_dir=host.root, notify=svc.kind == "ddtree")


def router_argv(host: Host, layout: Layout) -> list[str]:
    """`python -m sglang_router.launch_router` of the current release, in front of the backends.

    Backends are checked at their readiness path (`/ready` when every backend is the bundled
    server, whose `/health` is 200 while it still loads), every `health_check_interval_s`. The
    circuit breaker is off: sglang-router 0.3.2 counts every 429 of a busy backend as a failure
    and, after 10, refuses all requests with 503 `no_available_workers` for 60 s, although the
    backends are healthy (docs/operations.md "Routers"); dead backends are still dropped by the
    health checks and requests to them retried on another backend."""
    svc = host.service
    health = {b.health_path for b in host.backends}
    argv = [layout.router_python, "-m", "sglang_router.launch_router", "--host", host.bind, "--port", str(svc.port),
            "--worker-urls", *[b.base_url for b in host.backends]]
    if svc.policy is not None:
        argv += ["--policy", svc.policy]
    argv += ["--health-check-endpoint", health.pop() if len(health) == 1 else "/health",
             "--health-check-interval-secs", str(svc.health_check_interval_s), "--disable-circuit-breaker",
             "--prometheus-host", host.bind, "--prometheus-port", str(svc.metrics_port)]
    return argv


# ----------------------------------------------------------------------------- escaping filters

def _c_escape(value: str) -> str:
    out = []
    for ch in value:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def systemd_arg(value: object) -> str:
    """One ExecStart= word: `%`→`%%`, `$`→`$$`, C escapes, double quotes unless plain."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    return text if _PLAIN.match(text) else f'"{_c_escape(text)}"'


def argv_lines(argv: list[str]) -> list[list[str]]:
    """Group argv for display: a new line starts at each `--flag` (rendering only, argv unchanged)."""
    lines: list[list[str]] = []
    for arg in argv:
        if not lines or arg.startswith("--"):
            lines.append([arg])
        else:
            lines[-1].append(arg)
    return lines


def _exec_path(path: str) -> str:
    """The executable word: specifiers escaped, quoted when needed, `$` kept (never expanded)."""
    text = path.replace("%", "%%")
    return text if _PLAIN.match(text) else f'"{_c_escape(text)}"'


def exec_start(argv: list[str]) -> str:
    """The value of ExecStart=: escaped words, one `--flag value` group per continuation line.

    systemd expands `$` in argv but not in the executable path, so a path containing `$` is
    written as `@PATH ARGV0` (the `@` prefix sets argv[0] separately).
    """
    lines = argv_lines(argv)
    head = lines[0]
    first = ([_exec_path("@" + head[0]), systemd_arg(head[0])] if "$" in head[0] else [_exec_path(head[0])])
    words = [first + [systemd_arg(w) for w in head[1:]]] + [[systemd_arg(w) for w in ln] for ln in lines[1:]]
    return " \\\n    ".join(" ".join(ws) for ws in words)


def systemd_env_assignment(item: tuple[str, str]) -> str:
    """One `Environment=` word `"KEY=value"`: specifiers escaped, quoted ($ is literal there)."""
    key, value = item
    return f'"{_c_escape(f"{key}={value}".replace("%", "%%"))}"'


def systemd_path(value: object) -> str:
    """A path setting (WorkingDirectory=, EnvironmentFile=): specifiers escaped, taken verbatim."""
    text = str(value)
    if any(ch in text for ch in "\n\r") or text != text.strip():
        raise ValueError(f"path not usable in a unit file: {text!r}")
    return text.replace("%", "%%")


def env_file_value(value: object) -> str:
    """A value in EnvironmentFile syntax: bare when plain, else double-quoted with \\ " $ ` escaped."""
    text = str(value)
    if text and _PLAIN.match(text) and "%" not in text:
        return text
    return '"' + re.sub(r'([\\"$`])', r"\\\1", text) + '"'


# ----------------------------------------------------------------------------- rendering

def templates_dir() -> Path:
    """templates/ of the checkout, else the copy bundled in the ddtctl wheel."""
    here = Path(__file__).resolve().parents[1]
    for candidate in (here.parent / "templates", here / "_bundle" / "templates"):
        if (candidate / "service.env.j2").is_file():
            return candidate
    raise FileNotFoundError("ddtctl templates not found (neither templates/ nor ddtctl/_bundle/templates)")


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters.update(systemd_arg=systemd_arg, systemd_env=systemd_env_assignment,
                       systemd_path=systemd_path, env_value=env_file_value,
                       exec_start=exec_start)
    return env


def render_unit(spec: ServiceSpec) -> str:
    """The systemd unit text for `spec` (templates/<kind>.service.j2)."""
    return _env().get_template(f"{spec.kind}.service.j2").render(spec=spec)


def render_env(spec: ServiceSpec) -> str:
    """The EnvironmentFile text for `spec` (templates/service.env.j2)."""
    return _env().get_template("service.env.j2").render(spec=spec)


def render_local(spec: ServiceSpec) -> str:
    """The local supervisor's "unit": the spec as canonical JSON."""
    return json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n"


def unit_path(unit: str) -> str:
    """Where a systemd unit file is installed."""
    return f"/etc/systemd/system/{unit}"
