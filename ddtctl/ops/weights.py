"""Model weights: sha256 manifests, what to send, and read-only bind mounts for `shared` weights.

A model (a folder, or one file such as a GGUF) is described by a manifest {relative path:
{size, sha256}}. The manifest of the last complete push is stored beside the copy on the target
(`<dest>/.ddtctl-manifest.json`, or `<dest>.ddtctl-manifest.json` for a single file) together with
what each pushed file looked like on the target afterwards (`observed`: size, mtime, inode, from
one `find -printf`). Weights are verified by content, cheaply: a file is sent when its manifest
entry or its size on the target differs; it is re-hashed on the target (and sent when its sha256
differs) when its mtime or inode differs from the recorded ones (a same-size overwrite such as
`dd conv=notrunc` changes the mtime), and `verify=True` (`deploy --verify`) re-hashes every file.
Files below 8 MiB go together: hashed on the target in one command and sent as one verified tar
stream per batch (ops/weights_send.py, remote/push_many.py); larger ones with `Transport.put`,
which streams, resumes and verifies each file (it skips a file whose size and sha256 already
match). Local digests are cached in $DDTCTL_HOME/cache/sha256.json by
(path, size, mtime), so unchanged multi-GB weights are hashed once.

`shared` mode: weights go to the node once (`<models_root>/<name>`) and are bind-mounted read-only
into each container with `pct set VMID -mpN NODE_PATH,mp=CT_PATH,ro=1` (pct(1) "mp[n]"; docs/operations.md
§1 "Models").
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ddtctl.errors import RemoteError, UsageError
from ddtctl.inventory import ddtctl_home
from ddtctl.ops.weights_send import send_files, write_manifest
from ddtctl.remote.push import local_sha256

MANIFEST = ".ddtctl-manifest.json"
_lock = threading.Lock()


@dataclass
class WeightsResult:
    """Outcome of syncing one model: files and bytes actually sent (bytes), and where it went."""

    name: str
    dest: str
    files_total: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    bytes_total: int = 0
    files_rehashed: int = 0          # files whose sha256 was computed again on the target
    mount: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.files_sent > 0 or self.mount is not None

    def to_dict(self) -> dict:
        return {"name": self.name, "dest": self.dest, "files_total": self.files_total,
                "files_sent": self.files_sent, "bytes_sent": self.bytes_sent, "bytes_total": self.bytes_total,
                "files_rehashed": self.files_rehashed,
                "mount": self.mount, "changed": self.changed, "notes": self.notes}


def _cached_sha256(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    cache_file = ddtctl_home() / "cache" / "sha256.json"
    with _lock:
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return cache[key]
    digest = local_sha256(path)
    with _lock:
        cache[key] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(cache_file)
    return digest


def local_manifest(source: Path) -> dict[str, dict]:
    """Manifest of a local model folder or file. Raises UsageError if `source` does not exist."""
    source = source.expanduser()
    if source.is_file():
        return {source.name: {"size": source.stat().st_size, "sha256": _cached_sha256(source)}}
    if not source.is_dir():
        raise UsageError(f"model source {source} does not exist on this machine")
    out = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = path.relative_to(source).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):    # .git, .cache, hf lock files
            continue
        out[rel] = {"size": path.stat().st_size, "sha256": _cached_sha256(path)}
    return out


def remote_paths(source: Path, dest: str) -> tuple[str, str]:
    """(folder the files go into, manifest path) on the target for a model copied to `dest`."""
    if source.expanduser().is_file():
        return posixpath.dirname(dest) or "/", f"{dest}{MANIFEST}"
    return dest, posixpath.join(dest, MANIFEST)


def observe_argv(path: str, single_file: bool) -> list[str]:
    """`find` printing `<size> <mtime> <inode> <relative path>` for each file of a model folder,
    or for the one file `path` (its relative path is then printed empty)."""
    if single_file:
        return ["find", path, "-maxdepth", "0", "-type", "f", "-printf", "%s %T@ %i \\n"]
    return ["find", path, "-type", "f", "-printf", "%s %T@ %i %P\\n"]


def parse_observed(find_output: str, single_name: str | None = None) -> dict[str, list]:
    """{relative path: [size, mtime, inode]} from `observe_argv` output (pure); `single_name`:
    the manifest name of a single-file model."""
    out = {}
    for line in find_output.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4 or not parts[0].isdigit() or not parts[2].isdigit():
            continue
        rel = single_name if single_name is not None else parts[3]
        if rel:
            out[rel] = [int(parts[0]), parts[1], int(parts[2])]
    return out


def plan_sends(local: dict[str, dict], remote: dict[str, dict], recorded: dict[str, list],
               observed: dict[str, list], verify: bool = False) -> tuple[list[str], list[str]]:
    """(files to send, files to re-hash on the target first) (pure).

    Sent: the manifest entry differs, or the file is missing or has another size on the target.
    Re-hashed (sent only when the sha256 differs): its mtime or inode differs from what was
    recorded after the last push (or nothing was recorded), or `verify`."""
    send, rehash = [], []
    for rel, entry in local.items():
        seen = observed.get(rel)
        if remote.get(rel) != entry or seen is None or seen[0] != entry["size"]:
            send.append(rel)
        elif verify or recorded.get(rel) != seen:
            rehash.append(rel)
    return send, rehash


def parse_sizes(find_output: str) -> dict[str, int]:
    """{relative path: size} from `find DIR -type f -printf '%s %P\\n'`."""
    sizes = {}
    for line in find_output.splitlines():
        size, _, rel = line.partition(" ")
        if rel and size.isdigit():
            sizes[rel] = int(size)
    return sizes


def sizes_argv(folder: str) -> list[str]:
    return ["find", folder, "-type", "f", "-printf", "%s %P\\n"]


def read_remote_manifest(transport, path: str) -> tuple[dict[str, dict], dict[str, list]]:
    """(files, observed) of the manifest at `path` on the target ({} for what is not there)."""
    res = transport.run(["cat", path], timeout=60)
    if not res.ok:
        return {}, {}
    try:
        data = json.loads(res.text)
    except ValueError:
        return {}, {}
    if not isinstance(data, dict):
        return {}, {}
    return data.get("files", {}), data.get("observed", {})


def _observe(transport, source: Path, folder: str, dest: str) -> dict[str, list]:
    single = source.is_file()
    res = transport.run(observe_argv(dest if single else folder, single), timeout=120)
    return parse_observed(res.text, source.name if single else None) if res.ok else {}


def sync_model(transport, name: str, source: Path, dest: str, *, dry_run: bool = False,
               progress_factory=None, verify: bool = False) -> WeightsResult:
    """Make `dest` on the target hold exactly `source` (a folder or file); send only what changed
    (see the module docstring: size, mtime and inode recorded after the push decide what is
    re-hashed; `verify` re-hashes every file).

    `progress_factory(label, total_bytes)` returns a put-progress callback (or None).
    """
    source = source.expanduser()
    manifest = local_manifest(source)
    folder, manifest_path = remote_paths(source, dest)
    result = WeightsResult(name, dest, files_total=len(manifest),
                           bytes_total=sum(e["size"] for e in manifest.values()))
    remote, recorded = read_remote_manifest(transport, manifest_path)
    observed = _observe(transport, source, folder, dest)
    send, rehash = plan_sends(manifest, remote, recorded, observed, verify)
    if dry_run:
        result.files_sent, result.bytes_sent = len(send), sum(manifest[r]["size"] for r in send)
        result.notes.append("dry run: nothing sent" + (f", {len(rehash)} would be re-hashed" if rehash else ""))
        return result
    repaired = send_files(transport, name, source, dest, folder, manifest, send, rehash, observed, result,
                          progress_factory)
    if rehash:
        result.notes.append(f"{len(rehash)} re-hashed on the target"
                            + ("" if verify else " (changed there since the last push)")
                            + (f", {repaired} differed and were sent again" if repaired > 0 else ", all intact"))
    if send or rehash or remote != manifest:
        after = _observe(transport, source, folder, dest)
        write_manifest(transport, folder, manifest_path, {"files": manifest,
                                                          "observed": {r: after.get(r) for r in manifest}})
    return result


# ----------------------------------------------------------------------------- shared (bind mounts)

_MP = re.compile(r"^mp(\d+):\s*(.*)$")


def parse_mounts(pct_config: str) -> dict[int, dict[str, str]]:
    """{N: {"volume": ..., "mp": ..., "ro": ...}} from `pct config VMID` output."""
    mounts = {}
    for line in pct_config.splitlines():
        match = _MP.match(line.strip())
        if not match:
            continue
        volume, *opts = match.group(2).split(",")
        entry = {"volume": volume}
        entry.update(opt.split("=", 1) for opt in opts if "=" in opt)
        mounts[int(match.group(1))] = entry
    return mounts


def mount_plan(mounts: dict[int, dict[str, str]], node_path: str, ct_path: str) -> list[str] | None:
    """`pct set` arguments that add the read-only bind mount, or None when it is already there.

    Raises UsageError when `ct_path` is already mounted from somewhere else.
    """
    for n, entry in mounts.items():
        if entry.get("mp") == ct_path:
            if entry["volume"] == node_path and entry.get("ro") == "1":
                return None
            raise UsageError(f"mp{n} already mounts {entry['volume']} at {ct_path} (ro={entry.get('ro', '0')}); "
                             f"remove it (pct set VMID --delete mp{n}) or change the model path")
    free = next(i for i in range(256) if i not in mounts)
    return [f"-mp{free}", f"{node_path},mp={ct_path},ro=1"]


def pct_set_argv(vmid: int, args: list[str]) -> list[str]:
    return ["pct", "set", str(vmid), *args]


def shared_node_path(models_root: str, ct_path: str) -> str:
    """Where a shared model lives on the node: <models_root>/<base name of the container path>."""
    return posixpath.join(models_root, posixpath.basename(ct_path.rstrip("/")))


def sync_service_model(host, name: str, ref, transport, node_transport=None, *, dry_run: bool = False,
                       progress_factory=None, verify: bool = False) -> WeightsResult:
    """Make model `ref` ("target"/"drafter" of `host`) available at `ref.path` for the service.

    push: copy `ref.source` into the container (or local root). shared: copy it to the node once
    (`<models_root>/<name>`) and bind-mount it read-only at `ref.path`. Without `source` the model
    must already be there (on the node for shared). Raises RemoteError when it is missing, or when
    a new bind mount is not visible in the running container (then `pct reboot VMID`).
    """
    if host.service.weights == "shared":
        if node_transport is None or host.vmid is None:
            raise UsageError(f"{host.name}: `weights: shared` needs a Proxmox node")
        node_path = shared_node_path(host.node.models_root, ref.path)
        if ref.source:
            wr = sync_model(node_transport, name, Path(ref.source), node_path, dry_run=dry_run,
                            progress_factory=progress_factory, verify=verify)
        else:
            wr = _present(node_transport, name, node_path, dry_run, where=f"node {host.node_name}")
        cfg = node_transport.run(["pct", "config", str(host.vmid)], timeout=60).check().text
        plan = mount_plan(parse_mounts(cfg), node_path, ref.path)
        if plan:
            wr.mount = " ".join(plan)
            if not dry_run:
                node_transport.run(pct_set_argv(host.vmid, plan), timeout=120).check()
        if not dry_run and not transport.run(["test", "-e", ref.path], timeout=60).ok:
            raise RemoteError(f"{host.name}: {ref.path} is not visible in the container after `pct set` "
                              f"(restart it: pct reboot {host.vmid}, then deploy again)")
        return wr
    if ref.source:
        return sync_model(transport, name, Path(ref.source), ref.path, dry_run=dry_run,
                          progress_factory=progress_factory, verify=verify)
    return _present(transport, name, ref.path, dry_run, where=host.name)


def _present(transport, name: str, path: str, dry_run: bool, *, where: str) -> WeightsResult:
    if not transport.run(["test", "-e", path], timeout=60).ok:
        if not dry_run:
            raise RemoteError(f"{where}: model {name} not found at {path} "
                              "(add `source:` to push it from this machine)")
        return WeightsResult(name, path, notes=["missing: deploy will fail"])
    return WeightsResult(name, path)
