"""Pydantic schema of inventory.yaml (nodes, containers, local hosts) and the resolved `Host`.

Pure data: no file or network access here. `ddtctl.inventory` loads the YAML, maps validation
errors back to file lines, resolves cross references and selects hosts. Services live in
`ddtctl.inventory_services`, value rules in `ddtctl.inventory_values`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from ddtctl import inventory_values as rules
from ddtctl.inventory_services import (UNIT_NAME, DdtreeService, ModelRef, Packages, RouterService,
                                       Service, SglangService, VllmService)
from ddtctl.inventory_values import (ENV_NAME, HOST_NAME, Address, GroupName, InstallRoot, ModelPath,
                                     NoControl, rule)

__all__ = ["ENV_NAME", "HOST_NAME", "UNIT_NAME", "SMOLLM2_MODEL_ID", "Node", "ModelRef", "Container",
           "LocalHost", "InventoryModel", "Host", "DdtreeService", "SglangService", "VllmService", "RouterService", "Service", "Backend", "Packages", "PackageSettings"]

SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"   # the embedded default model of ddtree-server
# values OpenSSH accepts for StrictHostKeyChecking (ssh_config(5)), plus ddtctl's older `strict` (= yes)
HOST_KEY_CHECKING = ("yes", "accept-new", "no", "off", "ask", "strict")


def _ssh_scalar(value: Any) -> Any:
    """ssh_config values: YAML `yes`/`no` (booleans) mean the words, numbers their text."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value) if isinstance(value, (int, float)) else value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(_Strict):
    """A Proxmox VE node reached over SSH (`~/.ssh/config` is honoured by the transport)."""

    address: Annotated[str, rule(lambda v: rules.control_problem(v) or (
        "must not contain spaces or start with '-'" if " " in v or v.startswith("-") else None))] = Field(
        min_length=1, description="SSH host name, ssh_config alias or IP address.")
    user: Annotated[str, rule(lambda v: rules.control_problem(v) or (
        "must not contain spaces" if " " in v else None))] | None = Field(
        None, min_length=1, description="SSH user (default: ~/.ssh/config, then the local user).")
    port: int | None = Field(None, strict=True, ge=1, le=65535, description="SSH port (default: ~/.ssh/config, then 22).")
    ssh_options: dict[str, Annotated[NoControl, BeforeValidator(_ssh_scalar)]] = Field(
        default_factory=dict, description="ssh_config options given like `ssh -o KEY=VALUE` (they win over "
        "the ssh config file; OpenSSH evaluates them, ssh_config(5)).")
    models_root: Annotated[ModelPath, rule(rules.mount_path_problem)] = Field(
        "/srv/ddtctl/models", description="Node folder of `shared` weights (absolute).")

    @field_validator("ssh_options")
    @classmethod
    def _known_options(cls, value: dict[str, str]) -> dict[str, str]:
        for key, option in value.items():
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key):
                raise ValueError(f"{key!r} is not an ssh_config keyword (letters and digits, e.g. IdentityFile)")
            if key.lower() == "stricthostkeychecking" and option.lower() not in HOST_KEY_CHECKING:
                raise ValueError(f"StrictHostKeyChecking {option!r}: use {', '.join(HOST_KEY_CHECKING)}")
        return value


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
    packages: dict[str, Packages] = Field(default_factory=dict, description="group (or `all`) -> "
                                          "package settings of its ddtree hosts")


@dataclass(frozen=True)
class PackageSettings:
    """The resolved `packages:` of one ddtree host (defaults, `all`, its groups, its own keys)."""

    mode: str = "index"
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    trusted_hosts: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"mode": self.mode, "index_url": self.index_url, "extra_index_urls": list(self.extra_index_urls),
                "trusted_hosts": list(self.trusted_hosts), "pip_args": list(self.pip_args)}


@dataclass(frozen=True)
class Backend:
    """One service behind a router (resolved from the router's `backends` group)."""

    name: str
    kind: str                      # ddtree | sglang | vllm
    address: str
    port: int
    model_id: str

    @property
    def base_url(self) -> str:
        """`http://address:port` as the router reaches it (IPv6 in brackets)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    @property
    def health_path(self) -> str:
        """Readiness path of the backend: `/ready` for the bundled server (503 while loading, where
        its `/health` is already 200), `/health` for SGLang and vLLM."""
        return "/ready" if self.kind == "ddtree" else "/health"


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
    packages: PackageSettings | None = None      # ddtree and router services (inventory_refs.resolve_packages)
    backends: tuple[Backend, ...] = ()           # router services (inventory_router.resolve_routers)

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
        if svc.kind == "router":
            out += [((key,), f"a router serves no model of its own: remove `{key}:` (its backends "
                     "have the models and GPUs)") for key in ("target", "drafter", "gpus", "weights")
                    if key in svc.model_fields_set]
        out += rules.parallel_problems(svc)
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
        root = rules.normalize_path(os.path.expanduser(lh.root or default_root))
        return cls(name=name, kind="local", address=lh.address, root=root, service=lh.service,
                   groups=tuple(lh.groups))

    @property
    def url(self) -> str:
        """The OpenAI base URL of the service (IPv6 addresses in brackets)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.service.port}/v1"

    @property
    def bind(self) -> str:
        """Listen address passed to the service."""
        return self.service.bind or ("127.0.0.1" if self.kind == "local" else "0.0.0.0")
