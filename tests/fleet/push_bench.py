"""Time the wheelhouse sync into a fresh emulated container (real sshd + the pct emulation).

    python -m tests.fleet.push_bench [WHEELS_DIR] [--label NAME]

Syncs the wheels below 8 MiB of WHEELS_DIR (default `.cache/test-wheels`, `make test-wheels`),
then the whole folder, each into a new folder of one container, and each again (a re-run), with
the ddtctl on the Python path; prints per sync the wall time, the files sent and the commands
sent to the node (a `pct exec`, a streamed `pct exec`, or a whole SFTP put counted as one).
For a before/after comparison run it with `PYTHONPATH=<other checkout>:<other checkout>/server`
from that checkout. Needs root, openssh-server and util-linux (the test fleet's requirements).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from ddtctl.ops.weights import sync_model
from ddtctl.remote.pct import ContainerTransport
from tests.fleet.node import FakeNode
from tests.fleet.sshd import keygen

REPO = Path(__file__).resolve().parents[2]


class Counting:
    """A node transport counting the commands sent through it."""

    def __init__(self, inner):
        self.inner, self.n, self.name = inner, 0, inner.name

    def run(self, *args, **kw):
        self.n += 1
        return self.inner.run(*args, **kw)

    def stream(self, *args, **kw):
        self.n += 1
        return self.inner.stream(*args, **kw)

    def put(self, *args, **kw):
        self.n += 1
        return self.inner.put(*args, **kw)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheels", nargs="?", type=Path, default=REPO / ".cache" / "test-wheels")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="ddt-push-bench-"))
    os.environ["DDTCTL_HOME"] = str(base / "home")
    keygen(base / "id_ed25519")
    small = base / "small"
    small.mkdir()
    for wheel in args.wheels.glob("*.whl"):
        if wheel.stat().st_size < 8 * 1024 * 1024:
            (small / wheel.name).symlink_to(wheel.resolve())
    node = FakeNode("push-bench", base / "node", base / "id_ed25519").start()
    try:
        node.create_container(790, "ct790")
        ssh = node.transport()
        for name, src in (("small-wheels", small), ("wheelhouse", args.wheels)):
            files = [p for p in src.iterdir() if p.is_file()]
            mb = sum(p.stat().st_size for p in files) / 1e6
            for run in ("fresh", "re-run"):
                counting = Counting(ssh)
                t0 = time.monotonic()
                res = sync_model(ContainerTransport(counting, 790), name, src, f"/opt/{name}")
                print(f"{args.label}{name} ({len(files)} files, {mb:.0f} MB) {run}: {time.monotonic() - t0:.1f} s, "
                      f"{res.files_sent} sent, {counting.n} node commands", flush=True)
        ssh.close()
    finally:
        node.close()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
