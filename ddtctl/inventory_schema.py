"""Pydantic schema of inventory.yaml (nodes, containers, local hosts, services) and the resolved `Host`.

Pure data: no file or network access here. `ddtctl.inventory` loads the YAML, maps validation
errors back to file lines, resolves cross references and selects hosts.

One host runs one service. A service is the bundled `ddtree` server (installed by ddtctl from
the server wheel of this checkout) or an external engine (`sglang`, `vllm`) that ddtctl only
configures, starts and probes: it never builds or installs those.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from ddtctl import inventory_values as rules

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"   # the embedded default model of ddtree-server
UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]*\.service$")


def _scalar_to_str(value: Any) -> Any:
    """YAML `8` or `0.5` as an environment value means the string; booleans are refused."""
    if isinstance(value, bool):
        raise ValueError("use a quoted string ('true'/'1') for a boolean environment value")
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _ssh_scalar(value: Any) -> Any:
    """ssh_config values: YAML `yes`/`no` (booleans) mean the words, numbers their text."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value) if isinstance(value, (int, float)) else value


def _rule(check):
    """An AfterValidator raising the reason `check(value)` gives (see ddtctl/inventory_values.py)."""
    def validate(value):
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value
    return AfterValidator(validate)


def _env_name_problem(value: str) -> str | None:
    return None if ENV_NAME.match(value) else "is not a valid environment variable name (letters, digits, _)"


def _normalized(value: str) -> str:
    return rules.normalize_path(value)


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str), _rule(rules.env_value_problem)]
Address = Annotated[str, _rule(rules.address_problem)]
Executable = Annotated[str, _rule(rules.executable_problem)]
InstallRoot = Annotated[str, _rule(rules.install_root_problem), AfterValidator(_normalized)]
ModelPath = Annotated[str, _rule(rules.model_path_problem), AfterValidator(_normalized)]
NoControl = Annotated[str, _rule(rules.control_problem)]
GroupName = Annotated[str, _rule(lambda v: None if HOST_NAME.match(v) else
                                 "group names use letters, digits, '_', '.', '-' and start with a letter or digit")]
GpuId = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
                  _rule(rules.gpu_problem)]
SSH_OPTIONS = {"identityfile": "IdentityFile", "userknownhostsfile": "UserKnownHostsFile",
               "stricthostkeychecking": "StrictHostKeyChecking"}
HOST_KEY_CHECKING = ("accept-new", "yes", "strict")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(_Strict):
    """A Proxmox VE node reached over SSH (`~/.ssh/config` is honoured by the transport)."""

    address: Annotated[str, _rule(lambda v: rules.control_problem(v) or (
        "must not contain spaces or start with '-'" if " " in v or v.startswith("-") else None))] = Field(
        min_length=1, description="SSH host name, ssh_config alias or IP address.")
    user: Annotated[str, _rule(lambda v: rules.control_problem(v) or (
        "must not contain spaces" if " " in v else None))] | None = Field(
        None, min_length=1, description="SSH user (default: ~/.ssh/config, then the local user).")
    port: int | None = Field(None, strict=True, ge=1, le=65535, description="SSH port (default: ~/.ssh/config, then 22).")
    ssh_options: dict[str, Annotated[NoControl, BeforeValidator(_ssh_scalar)]] = Field(
        default_factory=dict, description="ssh_config options ddtctl reads: " + ", ".join(SSH_OPTIONS.values()))
    models_root: Annotated[ModelPath, _rule(rules.mount_path_problem)] = Field(
        "/srv/ddtctl/models", description="Node folder of `shared` weights (absolute).")

    @field_validator("ssh_options")
    @classmethod
    def _known_options(cls, value: dict[str, str]) -> dict[str, str]:
        for key, option in value.items():
            if key.lower() not in SSH_OPTIONS:
                raise ValueError(f"{key!r} is not read by ddtctl (it reads {', '.join(SSH_OPTIONS.values())}; "
                                 "put other options in ~/.ssh/config or $DDTCTL_SSH_CONFIG)")
            if key.lower() == "stricthostkeychecking" and option.lower() not in HOST_KEY_CHECKING:
                raise ValueError(f"StrictHostKeyChecking {option!r}: use {', '.join(HOST_KEY_CHECKING)}")
        return value


class ModelRef(_Strict):
    """Where a model (folder or GGUF file) lives.

    `path` is where the service reads it (inside the container or on the local host). `source`,
    when given, is a path on the machine running ddtctl: deploy pushes it to `path` (mode `push`)
    or to the node once and bind-mounts it read-only (mode `shared`). Without `source` the model
    must already be at `path`.
    """

    path: ModelPath = Field(min_length=1, description="Path the service reads (absolute).")
    source: str | None = Field(None, min_length=1, description="Local path to push from.")


class _ServiceBase(_Strict):
    port: int = Field(strict=True, ge=1, le=65535, description="TCP port the service listens on.")
    bind: Address | None = Field(None, description="Listen address (default 0.0.0.0; 127.0.0.1 on local hosts).")
    unit: str | None = Field(None, description="systemd unit name (default `<kind>.service`).")
    model_id: NoControl | None = Field(None, min_length=1, description="Served model id (default: the target's base name).")
    target: ModelRef | None = None
    drafter: ModelRef | None = None
    weights: Literal["push", "shared"] = Field("push", description="push = one copy per container; "
                                               "shared = one copy per node, bind-mounted read-only.")
    gpus: list[GpuId] = Field(
        default_factory=list, description="CUDA_VISIBLE_DEVICES entries (nvidia-smi indices or MIG UUIDs).")
    environment: dict[str, EnvValue] = Field(default_factory=dict, description="Extra environment.")
    extra_args: list[str] = Field(default_factory=list, description="Appended to the command line verbatim.")
    api_key_env: Annotated[str, _rule(_env_name_problem)] | None = Field(
        None, description="Local env var holding the API key for probes.")
    ready_timeout_s: float = Field(1800.0, strict=True, gt=0, allow_inf_nan=False,
                                   description="wait-ready deadline (seconds).")

    @field_validator("environment")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            problem = _env_name_problem(key)
            if problem:
                raise ValueError(f"{key!r} {problem}")
        return value

    @field_validator("unit")
    @classmethod
    def _unit_name(cls, value: str | None) -> str | None:
        if value is not None and not UNIT_NAME.match(value):
            raise ValueError("must look like `name.service` (letters, digits, _ . @ -)")
        if value is not None and "@." in value:
            raise ValueError("is a template unit (`name@.service` has no instance); name an instance "
                             "(`name@instance.service`) or drop the `@`")
        if value is not None and len(value) > 255:
            raise ValueError("is longer than 255 characters (systemd's limit for unit names)")
        return value


class DdtreeService(_ServiceBase):
    """The bundled `ddtree-server` (no target = the embedded SmolLM2-135M-Instruct GGUF)."""

    kind: Literal["ddtree"]
    mode: Literal["ar", "dflash", "ddtree"] | None = Field(None, description="Default: server decides.")
    tree_budget: int | None = Field(None, strict=True, ge=1, le=4096, description="DDTree node budget (nodes).")
    device: Literal["cuda", "cpu"] | None = None
    dtype: Literal["bf16", "fp32"] | None = None
    python: Executable | None = Field(None, description="Interpreter the release venv is made from "
                               "(default python3; on local hosts the one running ddtctl).")
    venv_args: list[str] = Field(default_factory=lambda: ["--system-site-packages"])
    pip_args: list[str] = Field(default_factory=lambda: ["--no-index", "--no-deps"])


class SglangService(_ServiceBase):
    """SGLang (`python -m sglang.launch_server`), DFlash drafting when a drafter is given."""

    kind: Literal["sglang"]
    python: Executable = Field("/usr/bin/python3", description="Interpreter that has sglang installed.")
    speculative_algorithm: str = "DFLASH"


class VllmService(_ServiceBase):
    """vLLM (`vllm serve MODEL`), `--speculative-config` JSON when a drafter is given."""

    kind: Literal["vllm"]
    executable: Executable = Field("/usr/local/bin/vllm", description="The `vllm` console script.")
    speculative_config: dict[str, Any] = Field(
        default_factory=lambda: {"method": "dflash", "num_speculative_tokens": 15},
        description="Merged into --speculative-config; `model` is set to the drafter path.")

    @field_validator("speculative_config")
    @classmethod
    def _json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be plain JSON (strings, numbers, booleans, lists, maps): {exc}") from None
        return value


Service = Annotated[Union[DdtreeService, SglangService, VllmService], Field(discriminator="kind")]


class Container(_Strict):
    """An LXC container on a Proxmox node, entered with `pct exec` / `pct push`."""

    vmid: int = Field(strict=True, ge=100, le=999_999_999, description="Proxmox VMID (100..999999999).")
    node: str = Field(min_length=1, description="Name of a node under `nodes:`.")
    address: Address = Field(description="Address the service is reached at over HTTP.")
    root: InstallRoot = Field("/opt/ddtree", description="Install root inside the container (absolute).")
    groups: list[GroupName] = Field(default_factory=list)
    service: Service


class LocalHost(_Strict):
    """This machine: no SSH, no Proxmox, no systemd; ddtctl's own process supervisor runs the service."""

    address: Address = Field("127.0.0.1", description="Address the service is reached at over HTTP.")
    root: str | None = Field(None, description="Install root (absolute or ~/...; default "
                             "$DDTCTL_HOME/hosts/<name>); checked after ~ is expanded.")
    groups: list[GroupName] = Field(default_factory=list)
    service: Service

    @field_validator("root")
    @classmethod
    def _absolute_or_home(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("/") or value == "~" or value.startswith("~/")):
            raise ValueError("must be an absolute path or start with ~/ (a relative root would depend on "
                             "the directory ddtctl and the service are started from)")
        return value


class InventoryModel(_Strict):
    """The whole file. Cross references (nodes, groups, names) are checked by `ddtctl.inventory`."""

    nodes: dict[str, Node] = Field(default_factory=dict)
    containers: dict[str, Container] = Field(default_factory=dict)
    local: dict[str, LocalHost] = Field(default_factory=dict)
    groups: dict[str, list[str]] = Field(default_factory=dict, description="group -> host names")


@dataclass(frozen=True)
class Host:
    """A resolved deploy target: a container (with its node) or a local host."""

    name: str
    kind: str                      # "container" | "local"
    address: str                   # HTTP address of the service
    root: str                      # install root on the target (releases/, current)
    service: Any                   # DdtreeService | SglangService | VllmService
    groups: tuple[str, ...] = ()
    node_name: str | None = None
    node: Node | None = None
    vmid: int | None = None

    @property
    def unit(self) -> str:
        """systemd unit name (also the local supervisor's service name)."""
        return self.service.unit or f"{self.service.kind}.service"

    @property
    def model_id(self) -> str:
        """The model id the service must list in /v1/models."""
        svc = self.service
        if svc.model_id:
            return svc.model_id
        if svc.target is None:
            return SMOLLM2_MODEL_ID
        base = svc.target.path.rstrip("/").rsplit("/", 1)[-1]
        return base[:-5] if base.endswith(".gguf") else base

    @property
    def section(self) -> str:
        """The inventory section the host is defined in."""
        return "containers" if self.kind == "container" else "local"

    def service_problems(self) -> list[tuple[tuple[str, ...], str]]:
        """(key path under `service`, message) for settings that do not fit this host (pure)."""
        svc, out = self.service, []
        if svc.kind in ("sglang", "vllm") and svc.target is None:
            out.append((("kind",), f"a {svc.kind} service needs `target:` (the model path)"))
        if self.kind == "local" and svc.kind != "ddtree":
            out.append((("kind",), "local hosts run the bundled ddtree server only"))
        if self.kind == "local" and svc.weights == "shared":
            out.append((("weights",), "`shared` weights need a Proxmox node; local hosts use `push`"))
        if svc.weights == "shared" and self.kind == "container":
            for name in ("target", "drafter"):
                ref = getattr(svc, name)
                problem = ref is not None and rules.mount_path_problem(ref.path)
                if problem:
                    out.append(((name, "path"), problem))
        return out

    @classmethod
    def of_container(cls, name: str, ct: Container, node: Node | None) -> "Host":
        return cls(name=name, kind="container", address=ct.address, root=ct.root, service=ct.service,
                   groups=tuple(ct.groups), node_name=ct.node, node=node, vmid=ct.vmid)

    @classmethod
    def of_local(cls, name: str, lh: LocalHost, default_root: str) -> "Host":
        return cls(name=name, kind="local", address=lh.address, root=os.path.expanduser(lh.root or default_root),
                   service=lh.service, groups=tuple(lh.groups))

    @property
    def url(self) -> str:
        """The OpenAI base URL of the service (IPv6 addresses in brackets)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.service.port}/v1"

    @property
    def bind(self) -> str:
        """Listen address passed to the service."""
        return self.service.bind or ("127.0.0.1" if self.kind == "local" else "0.0.0.0")
