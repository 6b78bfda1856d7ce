"""The repository stands alone: no tracker numbers (the word "issue" and a number) and no notes outside it.

A reader of the repository has neither the project's tracker nor the notes next to the checkout,
so code, tests and docs name the behaviour or the target instead of an issue number, and cite
public sources and the repository's own docs/ instead of `../shared/` paths. Issues of public
projects, written as `owner/repo issue #N`, are sources and stay allowed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".cache", ".ruff_cache", ".pytest_cache", "__pycache__", "build", "dist", ".venv"}
ISSUE = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
PUBLIC = re.compile(r"[\w.-]+/[\w.-]+\s+$")          # `owner/repo ` right before the match
OUTSIDE = re.compile(r"\.\./shared/|/work/shared\b")


def repo_text_files() -> list[Path]:
    """The checkout's text files (git's list when it is a git checkout; else every file)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                               cwd=ROOT, capture_output=True, check=True, timeout=60).stdout.split(b"\0")
        paths = [ROOT / n.decode() for n in names if n]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if not SKIP_DIRS & set(p.relative_to(ROOT).parts)]
    out = []
    for path in paths:
        if not path.is_file() or path.stat().st_size > 4_000_000:
            continue
        head = path.read_bytes()[:8192]
        if b"\0" not in head:
            out.append(path)
    return out


def offending(pattern: re.Pattern, text: str, allowed: re.Pattern | None = None) -> list[str]:
    hits = []
    for m in pattern.finditer(text):
        if allowed and allowed.search(text[max(0, m.start() - 120):m.start()]):
            continue
        hits.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    return hits


def _scan(pattern, allowed=None) -> list[str]:
    found = []
    for path in repo_text_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in offending(pattern, text, allowed)]
    return found


def test_the_patterns():
    w = "issue"   # the samples are built, so that a plain `git grep` of the repository finds none either
    assert offending(ISSUE, f"a test of {w} 9, class 3") == [f"line 1: '{w} 9'"]
    assert offending(ISSUE, f"## Targets ({w.title()} 4)\nsee {w}s\n#10") == [f"line 1: '{w.title()} 4'",
                                                                           f"line 2: '{w}s\\n#10'"]
    assert offending(ISSUE, "(ansible/ansible issue #19720; linux-pam/linux-pam issue\n#792)", PUBLIC) == []
    assert offending(ISSUE, "the issue is 3 bytes long") == []
    assert offending(OUTSIDE, "see ../shared/reference/ops.md") == ["line 1: '../shared/'"]
    assert len(repo_text_files()) > 100


def test_no_tracker_issue_numbers():
    found = _scan(ISSUE, PUBLIC)
    assert not found, "name the behaviour or the target instead of an issue number:\n" + "\n".join(found)


def test_no_paths_outside_the_repository():
    found = _scan(OUTSIDE)
    assert not found, "cite public sources or docs/ instead of notes outside the repository:\n" + "\n".join(found)
