"""Service settings of inventory.yaml: models, packages, and the ddtree / sglang / vllm services.

Pure data (pydantic); value rules come from `ddtctl.inventory_values`. One host runs one service:
the bundled `ddtree` server (installed by ddtctl from the server wheel of this checkout) or an
external engine (`sglang`, `vllm`) that ddtctl only configures, starts and probes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ddtctl.inventory_values import (Address, EnvName, EnvValue, Executable, GpuId, ModelPath, NoControl,
                                     address_problem, env_name_problem, rule, url_problem)

Url = Annotated[str, rule(url_problem)]
UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]*\.service$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRef(_Strict):
    """Where a model (folder or GGUF file) lives.

    `path` is where the service reads it (inside the container or on the local host). `source`,
    when given, is a path on the machine running ddtctl: deploy pushes it to `path` (mode `push`)
    or to the node once and bind-mounts it read-only (mode `shared`). Without `source` the model
    must already be at `path`.
    """

    path: ModelPath = Field(min_length=1, description="Path the service reads (absolute).")
    source: str | None = Field(None, min_length=1, description="Local path to push from.")


class Packages(_Strict):
    """How a ddtree release venv gets the server's dependencies (docs/operations.md "Dependencies").

    `index`: a venv without system site packages, `pip install` of the server wheel from a
    package index the target reaches (`index_url`, else pip's own configuration there, else PyPI;
    plus `extra_index_urls`, e.g. PyTorch's CUDA wheels). `wheelhouse`: ddtctl downloads every
    wheel on this machine for the target's Python and platform and pushes them (air-gapped
    targets); pip installs with `--no-index`. `system`: the old way, a `--system-site-packages`
    venv and `pip --no-index --no-deps`: the interpreter must already have every dependency.
    Unset keys come from `packages:` groups, then the default (`index` for containers, `system`
    for local hosts).
    """

    mode: Literal["index", "wheelhouse", "system"] | None = None
    index_url: Url | None = Field(None, description="pip --index-url (index and wheelhouse modes).")
    extra_index_urls: list[Url] | None = Field(None, description="pip --extra-index-url, in order.")
    trusted_hosts: list[Annotated[str, rule(address_problem)]] | None = Field(
        None, description="pip --trusted-host (plain-HTTP or self-signed indexes).")
    pip_args: list[str] | None = Field(None, description="More `pip install` (and `pip download`) options.")


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
    environment: dict[EnvName, EnvValue] = Field(default_factory=dict, description="Extra environment.")
    extra_args: list[str] = Field(default_factory=list, description="Appended to the command line verbatim.")
    api_key_env: Annotated[str, rule(env_name_problem)] | None = Field(
        None, description="Local env var holding the API key for probes.")
    ready_timeout_s: float = Field(1800.0, strict=True, gt=0, allow_inf_nan=False,
                                   description="wait-ready deadline (seconds).")

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
    packages: Packages | None = Field(None, description="Where the release venv's dependencies come from.")


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
