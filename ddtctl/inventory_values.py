"""What an inventory value may contain so that it also deploys (pure checks, no I/O).

Each `*_problem(value)` returns None, or the reason the value cannot work where ddtctl puts it;
the schema (`inventory_schema.py`) turns a reason into a validation error, so a value the
inventory accepts never fails later at deploy. Where each kind of value ends up, and why:

* **Install roots** (`root:`, the default `$DDTCTL_HOME/hosts/<name>`) become the release venv,
  the console scripts' interpreter line, `WorkingDirectory=`, `ExecStart=` and
  `EnvironmentFile=` of the unit. pip writes a console script whose interpreter path has a space
  or is longer than 127 bytes as a `/bin/sh` launcher (`'''exec' "PATH" "$0" "$@"`), where
  `$`, the backquote, `\\`, `"`, `'`, `;`, `&`, `|`, `<`, `>`, `(`, `)`, `*`, `?`, `[` are shell
  syntax; `python -m venv` refuses `:` (the PATH separator); systemd refuses quotes,
  backslashes and control characters in an executable path ("Executable name contains special
  characters", systemd.service(5)) and `..` in `WorkingDirectory=`, and reads
  `EnvironmentFile=` as a glob (`* ? [`). So roots are absolute and use only
  ``A-Z a-z 0-9 / . _ - + , = @ % ~`` and spaces, without `..` components.
* **Model paths** are argv words, push destinations and, with `weights: shared`, part of
  `pct set -mpN NODE_PATH,mp=CT_PATH,ro=1` (a Proxmox property string: `,` separates
  properties, `=` splits key from value): absolute, below `/`, no `..`, no control characters;
  shared ones also without `,` and `=`.
* **Executables** (`python`, `executable`) are the first `ExecStart=` word or an argv[0]:
  an absolute path or a command name, without quotes, backslashes or control characters.
* **Addresses** end up in URLs and listen addresses: an IP address or a host name (RFC 1123
  labels; `_` tolerated).
* **GPU ids** are joined with `,` into `CUDA_VISIBLE_DEVICES`: an index or a GPU/MIG UUID.
* **Environment values** go into an EnvironmentFile: systemd.exec(5) allows any Unicode scalar
  value except NUL, U+FEFF and the Unicode noncharacters.
* **Every string** of the file: no NUL (cannot be part of an argv or a path) and no lone
  surrogate (cannot be written as UTF-8).
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

ROOT_CHARS = re.compile(r"^[A-Za-z0-9 ._+,=@%~/-]+$")
ROOT_CHARS_TEXT = "letters, digits, spaces and / . _ - + , = @ % ~"
COMMAND_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
HOST_LABEL = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
GPU_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9/_.-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_EXEC_SPECIAL = re.compile(r"[\"'\\]")
NAME_MAX = 255


def string_problem(value: str) -> str | None:
    """NUL or a lone surrogate anywhere (every string of the inventory)."""
    if "\x00" in value:
        return "contains a NUL character (\\0), which no argv, path or file can carry"
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        return "contains a lone UTF-16 surrogate, which cannot be written as UTF-8"
    return None


def control_problem(value: str) -> str | None:
    """Control characters (tab, newline, ESC, DEL, C1)."""
    match = _CONTROL.search(value)
    if match:
        return f"contains the control character {match.group()!r} (tab, newline, ... are not allowed here)"
    return None


def _path_shape_problem(path: str) -> str | None:
    if not path.startswith("/"):
        return "must be an absolute path (starting with /)"
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        return "must not contain `..` components (systemd refuses paths that are not normalized)"
    if any(len(p.encode()) > NAME_MAX for p in parts):
        return f"has a path component longer than {NAME_MAX} bytes"
    return None


def normalize_path(path: str) -> str:
    """`//` and `/./` collapsed, trailing `/` removed (call after the checks above)."""
    return posixpath.normpath(re.sub(r"/+", "/", path)) if path.startswith("/") else path


def install_root_problem(path: str) -> str | None:
    """An install root (absolute; see the module docstring for the characters)."""
    shape = _path_shape_problem(path)
    if shape:
        return shape
    if not ROOT_CHARS.match(path):
        bad = sorted({ch for ch in path if not ROOT_CHARS.match(ch)})
        shown = " ".join(repr(ch) for ch in bad)
        return (f"contains {shown}: install roots use only {ROOT_CHARS_TEXT} (the path becomes the "
                "venv, the console scripts' /bin/sh launcher and systemd's ExecStart=, "
                "WorkingDirectory= and EnvironmentFile=)")
    if path.strip() != path or any(p != p.strip() for p in path.split("/")):
        return "has a path component that starts or ends with a space"
    if normalize_path(path) == "/":
        return "must be a folder below / (releases/, current and the lock live in it)"
    return None


def model_path_problem(path: str) -> str | None:
    """A model path (argv word and push destination)."""
    shape = _path_shape_problem(path) or control_problem(path)
    if shape:
        return shape
    if normalize_path(path) == "/":
        return "must name a file or folder below /"
    return None


def mount_path_problem(path: str) -> str | None:
    """A path inside `pct set -mpN NODE_PATH,mp=CT_PATH,ro=1` (after `model_path_problem`)."""
    bad = sorted(set(path) & {",", "="})
    if bad:
        return (f"contains {' and '.join(repr(c) for c in bad)}: a `weights: shared` path is part of the "
                "Proxmox mount option `NODE_PATH,mp=CT_PATH,ro=1`, where `,` and `=` are syntax")
    return None


def executable_problem(value: str) -> str | None:
    """An interpreter or console script: absolute path or command name (systemd ExecStart=)."""
    problem = control_problem(value)
    if problem:
        return problem
    if _EXEC_SPECIAL.search(value):
        return "must not contain quotes or backslashes (systemd refuses them in an executable path)"
    if value.startswith("/"):
        return _path_shape_problem(value)
    if not COMMAND_NAME.match(value):
        return "must be an absolute path or a command name (letters, digits, _ . + -)"
    return None


def address_problem(value: str) -> str | None:
    """An IP address or a host name."""
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    if len(name) > 253 or not name or not all(HOST_LABEL.match(label) for label in name.split(".")):
        return "must be an IP address or a host name (letters, digits, '-', '_', dot-separated labels)"
    return None


def gpu_problem(value: str) -> str | None:
    """One CUDA_VISIBLE_DEVICES entry."""
    if not GPU_ID.match(value):
        return (f"{value!r} is not a GPU index or UUID (GPU-..., MIG-...): entries are joined with ',' "
                "into CUDA_VISIBLE_DEVICES")
    return None


def env_value_problem(value: str) -> str | None:
    """A value for an EnvironmentFile (systemd.exec(5) "EnvironmentFile=")."""
    for ch in value:
        code = ord(ch)
        if code == 0xFEFF:
            return "contains U+FEFF (byte order mark), which systemd does not accept in an EnvironmentFile"
        if 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFE) == 0xFFFE:
            return f"contains the Unicode noncharacter U+{code:04X}, which systemd does not accept in an EnvironmentFile"
    return None


def url_problem(value: str) -> str | None:
    """A package index URL (http, https or file)."""
    if control_problem(value) or " " in value:
        return "must not contain spaces or control characters"
    if not re.match(r"^(https?|file)://[^/?#]*", value) or value in ("http://", "https://"):
        return "must be an http://, https:// or file:// URL"
    return None


# ----------------------------------------------------------------------------- pydantic types

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _scalar_to_str(value: Any) -> Any:
    """YAML `8` or `0.5` as an environment value means the string; booleans are refused."""
    if isinstance(value, bool):
        raise ValueError("use a quoted string ('true'/'1') for a boolean environment value")
    if isinstance(value, (int, float)):
        return str(value)
    return value


def rule(check):
    """An AfterValidator raising the reason `check(value)` gives."""
    def validate(value):
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value
    return AfterValidator(validate)


def env_name_problem(value: str) -> str | None:
    return None if ENV_NAME.match(value) else "is not a valid environment variable name (letters, digits, _)"


def _normalized(value: str) -> str:
    return normalize_path(value)


EnvValue = Annotated[str, BeforeValidator(_scalar_to_str), rule(env_value_problem)]
# keys are checked apart from the values, so a bad name is reported beside a bad value of the same map
EnvName = Annotated[str, rule(env_name_problem)]
Address = Annotated[str, rule(address_problem)]
Executable = Annotated[str, rule(executable_problem)]
InstallRoot = Annotated[str, rule(install_root_problem), AfterValidator(_normalized)]
ModelPath = Annotated[str, rule(model_path_problem), AfterValidator(_normalized)]
NoControl = Annotated[str, rule(control_problem)]
GroupName = Annotated[str, rule(lambda v: None if HOST_NAME.match(v) else
                                "group names use letters, digits, '_', '.', '-' and start with a letter or digit")]
GpuId = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
                  rule(gpu_problem)]
