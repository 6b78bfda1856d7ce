"""Split large files into parts (and join them back), for machines that return files <= 16 MiB.

`python -m ddtree_server.train.split DIR [--max-mib 15]` replaces every file in DIR larger than the
limit by `NAME.part00`, `NAME.part01`, ... and writes `SHA256SUMS` (sha256 of every whole file).
`python -m ddtree_server.train.split --join DIR` restores the files and checks them against
SHA256SUMS (raises SystemExit with the name of a file whose hash differs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ddtree_server.models.default import sha256_file

SUMS = "SHA256SUMS"


def split_large(folder: str | Path, max_bytes: int) -> list[Path]:
    """Split files of `folder` over `max_bytes` into parts; write SHA256SUMS. Returns the parts."""
    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != SUMS and ".part" not in p.name)
    (folder / SUMS).write_text("".join(f"{sha256_file(p)}  {p.name}\n" for p in files))
    parts: list[Path] = []
    for p in files:
        if p.stat().st_size <= max_bytes:
            continue
        with open(p, "rb") as fh:
            i = 0
            while chunk := fh.read(max_bytes):
                part = folder / f"{p.name}.part{i:02d}"
                part.write_bytes(chunk)
                parts.append(part)
                i += 1
        p.unlink()
    return parts


def join_parts(folder: str | Path) -> list[Path]:
    """Reassemble `NAME.partNN` files and verify every file listed in SHA256SUMS.
    Raises ValueError naming a file whose sha256 differs or that is missing."""
    folder = Path(folder)
    joined: list[Path] = []
    for first in sorted(folder.glob("*.part00")):
        name = first.name[: -len(".part00")]
        parts = sorted(folder.glob(f"{name}.part[0-9][0-9]"))
        with open(folder / name, "wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        for part in parts:
            part.unlink()
        joined.append(folder / name)
    sums = folder / SUMS
    if sums.exists():
        for line in sums.read_text().splitlines():
            digest, name = line.split(maxsplit=1)
            path = folder / name.strip()
            if not path.exists() or sha256_file(path) != digest:
                raise ValueError(f"{path}: missing or sha256 differs from {SUMS}")
    return joined


def main(argv: list[str] | None = None) -> None:
    """CLI entry (see module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--max-mib", type=float, default=15.0)
    ap.add_argument("--join", action="store_true", help="reassemble parts and verify SHA256SUMS")
    args = ap.parse_args(argv)
    try:
        done = join_parts(args.folder) if args.join else split_large(args.folder, int(args.max_mib * 2**20))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print("\n".join(str(p) for p in done) or "nothing to do")


if __name__ == "__main__":
    main()
