"""Remote half of release verification: a stdlib-only script run as `python3 -c SOURCE MODE ARGS...`.

ddtctl sends this file's text (`source()`) to the target's interpreter, so it must run on any
Python >= 3.8 without third-party modules and never import ddtctl. Every mode prints one JSON
document on stdout. Modes:

* `write REL META` — list every file of the release folder REL and write the manifest
  `REL/.ddtctl-release.json` = META (a JSON object) + `files`: {relative path: [size, mtime_ns,
  sha256]} for regular files (sha256 null above HASH_LIMIT: `check` compares no hash there),
  ["link", target] for symlinks. `__pycache__` folders and `*.pyc` are left out (the
  interpreter rewrites them). Prints the counts `check` would print for the folder as written
  (`files`, `hashed`), so the installer need not list and hash it a second time.
* `check REL` — compare REL with its manifest. Cheap by design: every entry's type and size, and
  mtime (ns) for files; a full sha256 only for files up to HASH_LIMIT bytes (the Python sources,
  metadata and console scripts: ~250 MB in ~2 s for a CPU torch venv). A larger file (shared
  libraries, weights) changed in place with its size and mtime restored is not noticed. Files
  that are missing, changed, or not in the manifest are problems.
* `deps DIST [PRESENT...]` — run by the release venv's interpreter: every distribution in the
  requirement closure of installed distribution DIST, and each PRESENT distribution itself (the
  embedded model's data wheel, installed `--no-deps`, when the service needs it) (extras left out, markers evaluated with pip's vendored
  `packaging`) must be installed. Presence only: versions were pip's business at install time,
  and a `--system-site-packages` interpreter often carries harmless specifier mismatches
  (`pip check` would fail on those, and on unrelated packages).
* `facts` — the interpreter's version, implementation, glibc version and machine (wheelhouse
  tags are derived from them in `ops/packages.py`).
"""

import hashlib
import json
import os
import platform
import sys

MANIFEST = ".ddtctl-release.json"
HASH_LIMIT = 1 << 20
MAX_PROBLEMS = 20


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _walk(rel_dir):
    """(relative path, os.stat_result) of every file and symlink below rel_dir (manifest excluded)."""
    for dirpath, dirnames, filenames in os.walk(rel_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        names = sorted(filenames) + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, rel_dir)
            if rel == MANIFEST or name.endswith(".pyc"):
                continue
            yield rel, path, os.lstat(path)


def _entry(path, st):
    if os.path.islink(path):
        return ["link", os.readlink(path)]
    return [st.st_size, st.st_mtime_ns, _sha256(path) if st.st_size <= HASH_LIMIT else None]


def write(rel_dir, meta_json):
    files = {rel: _entry(path, st) for rel, path, st in _walk(rel_dir)}
    doc = dict(json.loads(meta_json), files=files)
    tmp = os.path.join(rel_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"), sort_keys=True)
    os.replace(tmp, os.path.join(rel_dir, MANIFEST))
    hashed = sum(1 for e in files.values() if e[0] != "link" and e[2] is not None)
    return {"ok": True, "files": len(files), "hashed": hashed}


def check(rel_dir):
    try:
        with open(os.path.join(rel_dir, MANIFEST)) as fh:
            doc = json.load(fh)
        expected = doc.pop("files")
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        what = "no manifest" if isinstance(exc, FileNotFoundError) else "unreadable manifest"
        return {"ok": False, "meta": None, "files": 0, "hashed": 0, "problem_count": 1,
                "problems": [f"{what} {MANIFEST} ({type(exc).__name__})"]}
    problems, seen, hashed = [], set(), 0
    for rel, path, st in _walk(rel_dir):
        seen.add(rel)
        want = expected.get(rel)
        if want is None:
            problems.append(f"{rel}: not in the manifest")
            continue
        if want[0] == "link" or os.path.islink(path):
            if want != _entry(path, st):
                problems.append(f"{rel}: symlink changed")
            continue
        size, mtime_ns, sha = want
        if st.st_size != size:
            problems.append(f"{rel}: size {st.st_size} != {size}")
        elif st.st_size <= HASH_LIMIT:
            hashed += 1
            if _sha256(path) != sha:
                problems.append(f"{rel}: sha256 differs")
        elif st.st_mtime_ns != mtime_ns:
            problems.append(f"{rel}: modified (mtime)")
    problems += [f"{rel}: missing" for rel in sorted(set(expected) - seen)]
    return {"ok": not problems, "meta": doc, "files": len(seen), "hashed": hashed,
            "problem_count": len(problems), "problems": problems[:MAX_PROBLEMS]}


def deps(dist_name, *present):
    from importlib import metadata

    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

    problems, seen, todo = [], set(), [(dist_name, None)]
    for name in present:
        try:
            metadata.distribution(name)
            seen.add((canonicalize_name(name), None))
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed")
    while todo:
        name, extra = todo.pop()
        key = canonicalize_name(name)
        if (key, extra) in seen:
            continue
        seen.add((key, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            env = {"extra": extra or ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            try:
                metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{req.name} (needed by {dist.metadata['Name']}): not installed")
                continue
            todo += [(req.name, None)] + [(req.name, e) for e in sorted(req.extras)]
    return {"ok": not problems, "checked": len({k for k, _ in seen}), "problems": problems[:MAX_PROBLEMS],
            "problem_count": len(problems)}


def facts():
    libc, version = platform.libc_ver()
    return {"python": "%d.%d" % sys.version_info[:2], "implementation": sys.implementation.name,
            "libc": libc, "libc_version": version, "machine": platform.machine(),
            "executable": sys.executable}


def main(argv):
    mode = argv[0]
    if mode == "write":
        out = write(argv[1], argv[2])
    elif mode == "check":
        out = check(argv[1])
    elif mode == "deps":
        out = deps(*argv[1:])
    elif mode == "facts":
        out = facts()
    else:
        raise SystemExit("unknown mode %r" % mode)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])


def source() -> str:
    """This file's text, for `python3 -c` (`__name__ == "__main__"` there, so main() runs)."""
    with open(__file__, encoding="utf-8") as fh:
        return fh.read()
