"""Pydantic schema of inventory.yaml (nodes, containers, local hosts, services) and the resolved `Host`.

Pure data: no file or network access here. `ddtctl.inventory` loads the YAML, maps validation
errors back to file lines, resolves cross references and selects hosts.

One host runs one service. A service is the bundled `ddtree` server (installed by ddtctl from
the server wheel of this checkout) or an external engine (`sglang`, `vllm`) that ddtctl only
configures, starts and probes: it never builds or installs those.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

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


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(_Strict):
    """A Proxmox VE node reached over SSH (`~/.ssh/config` is honoured by the transport)."""

    address: str = Field(min_length=1, description="SSH host name or IP address.")
    user: str | None = Field(None, description="SSH user (default: ~/.ssh/config, then the local user).")
    port: int | None = Field(None, strict=True, ge=1, le=65535, description="SSH port (default: ~/.ssh/config, then 22).")
    ssh_options: dict[str, EnvValue] = Field(default_factory=dict, description="Extra ssh_config options.")
    models_root: str = Field("/srv/ddtctl/models", description="Node folder of `shared` weights (absolute).")

    @field_validator("models_root")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value


class ModelRef(_Strict):
    """Where a model (folder or GGUF file) lives.

    `path` is where the service reads it (inside the container or on the local host). `source`,
    when given, is a path on the machine running ddtctl: deploy pushes it to `path` (mode `push`)
    or to the node once and bind-mounts it read-only (mode `shared`). Without `source` the model
    must already be at `path`.
    """

    path: str = Field(min_length=1, description="Path the service reads (absolute).")
    source: str | None = Field(None, min_length=1, description="Local path to push from.")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value.rstrip("/") or "/"


class _ServiceBase(_Strict):
    port: int = Field(strict=True, ge=1, le=65535, description="TCP port the service listens on.")
    bind: str | None = Field(None, description="Listen address (default 0.0.0.0; 127.0.0.1 on local hosts).")
    unit: str | None = Field(None, description="systemd unit name (default `<kind>.service`).")
    model_id: str | None = Field(None, description="Served model id (default: the target's base name).")
    target: ModelRef | None = None
    drafter: ModelRef | None = None
    weights: Literal["push", "shared"] = Field("push", description="push = one copy per container; "
                                               "shared = one copy per node, bind-mounted read-only.")
    gpus: list[Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) else v)]] = Field(
        default_factory=list, description="CUDA_VISIBLE_DEVICES entries (nvidia-smi indices or MIG UUIDs).")
    environment: dict[str, EnvValue] = Field(default_factory=dict, description="Extra environment.")
    extra_args: list[str] = Field(default_factory=list, description="Appended to the command line verbatim.")
    api_key_env: str | None = Field(None, description="Local env var holding the API key for probes.")
    ready_timeout_s: float = Field(1800.0, strict=True, gt=0, description="wait-ready deadline (seconds).")

    @field_validator("environment")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
        return value

    @field_validator("unit")
    @classmethod
    def _unit_name(cls, value: str | None) -> str | None:
        if value is not None and not UNIT_NAME.match(value):
            raise ValueError("must look like `name.service` (letters, digits, _ . @ -)")
        return value


class DdtreeService(_ServiceBase):
    """The bundled `ddtree-server` (no target = the embedded SmolLM2-135M-Instruct GGUF)."""

    kind: Literal["ddtree"]
    mode: Literal["ar", "dflash", "ddtree"] | None = Field(None, description="Default: server decides.")
    tree_budget: int | None = Field(None, strict=True, ge=1, le=4096, description="DDTree node budget (nodes).")
    device: Literal["cuda", "cpu"] | None = None
    dtype: Literal["bf16", "fp32"] | None = None
    python: str | None = Field(None, description="Interpreter the release venv is made from "
                               "(default python3; on local hosts the one running ddtctl).")
    venv_args: list[str] = Field(default_factory=lambda: ["--system-site-packages"])
    pip_args: list[str] = Field(default_factory=lambda: ["--no-index", "--no-deps"])


class SglangService(_ServiceBase):
    """SGLang (`python -m sglang.launch_server`), DFlash drafting when a drafter is given."""

    kind: Literal["sglang"]
    python: str = Field("/usr/bin/python3", description="Interpreter that has sglang installed.")
    speculative_algorithm: str = "DFLASH"


class VllmService(_ServiceBase):
    """vLLM (`vllm serve MODEL`), `--speculative-config` JSON when a drafter is given."""

    kind: Literal["vllm"]
    executable: str = Field("/usr/local/bin/vllm", description="The `vllm` console script.")
    speculative_config: dict[str, Any] = Field(
        default_factory=lambda: {"method": "dflash", "num_speculative_tokens": 15},
        description="Merged into --speculative-config; `model` is set to the drafter path.")


Service = Annotated[Union[DdtreeService, SglangService, VllmService], Field(discriminator="kind")]


class Container(_Strict):
    """An LXC container on a Proxmox node, entered with `pct exec` / `pct push`."""

    vmid: int = Field(strict=True, ge=100, le=999_999_999, description="Proxmox VMID (100..999999999).")
    node: str = Field(min_length=1, description="Name of a node under `nodes:`.")
    address: str = Field(min_length=1, description="Address the service is reached at over HTTP.")
    root: str = Field("/opt/ddtree", description="Install root inside the container (absolute).")
    groups: list[str] = Field(default_factory=list)
    service: Service

    @field_validator("root")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path")
        return value.rstrip("/") or "/"


class LocalHost(_Strict):
    """This machine: no SSH, no Proxmox, no systemd; ddtctl's own process supervisor runs the service."""

    address: str = Field("127.0.0.1", description="Address the service is reached at over HTTP.")
    root: str | None = Field(None, description="Install root (default $DDTCTL_HOME/hosts/<name>).")
    groups: list[str] = Field(default_factory=list)
    service: Service


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
    def bind(self) -> str:
        """Listen address passed to the service."""
        return self.service.bind or ("127.0.0.1" if self.kind == "local" else "0.0.0.0")
