"""Emulation of how ``pct`` parses its command line (pve-common src/PVE/JSONSchema.pm): PVE::JSONSchema::get_options,
i.e. Getopt::Long ``GetOptionsFromArray`` in its default *permute* mode.

* options are recognised anywhere before a literal ``--`` (after positionals too), with ``-`` or
  ``--`` prefix, ``--opt value`` or ``--opt=value``, unique prefixes accepted (auto_abbrev);
* ``--`` is consumed and everything after it is positional;
* a word starting with ``-`` that is no known option -> "Unknown option: <name>" and
  "400 unable to parse option" (so ``pct exec 200 ls -la`` fails);
* booleans take an optional value (``:s``): the next word is taken unless it looks like an option;
  '' -> 1, 1/0/yes/no/true/false/on/off accepted;
* the last positional of a command may swallow the rest (``extra-args`` of ``exec``).
"""

from __future__ import annotations

import re

TRUE = {"1", "yes", "true", "on", ""}
FALSE = {"0", "no", "false", "off"}


class ParseError(Exception):
    """Message lines to print before the usage line; pct exits 255."""


def _lookup(name: str, spec: dict[str, str]) -> str:
    if name in spec:
        return name
    for pattern, kind in spec.items():  # indexed options such as mp[n]
        if pattern.endswith("[n]") and re.fullmatch(re.escape(pattern[:-3]) + r"\d{1,3}", name):
            return name
    matches = [k for k in spec if k.startswith(name) and not k.endswith("[n]")]
    if len(matches) == 1:
        return matches[0]
    raise ParseError(f"Unknown option: {name}" if not matches else f"Option {name} is ambiguous")


def _kind(name: str, spec: dict[str, str]) -> str:
    if name in spec:
        return spec[name]
    return spec[re.sub(r"\d+$", "[n]", name)]


def parse(words: list[str], spec: dict[str, str], positionals: list[str]
          ) -> tuple[dict[str, object], dict[str, object]]:
    """Parse ``words`` against ``spec`` (name -> "bool" | "string" | "int"; ``mp[n]`` for indexed)
    and positional names (a trailing ``*`` marks a rest-array). Returns (positionals, options).
    Raises ParseError with pct's messages."""
    opts: dict[str, object] = {}
    free: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            free.extend(words[i:])
            break
        if len(word) < 2 or not word.startswith("-"):
            free.append(word)
            continue
        body = word[2:] if word.startswith("--") else word[1:]
        name, eq, value = body.partition("=")
        try:
            name = _lookup(name, spec)
        except ParseError as exc:
            raise ParseError(f"{exc}\n400 unable to parse option") from None
        kind = _kind(name, spec)
        if not eq:
            nxt = words[i] if i < len(words) else None
            if kind == "bool":
                if nxt is not None and not nxt.startswith("-"):
                    value, i = nxt, i + 1
            elif nxt is None:
                raise ParseError(f"Option {name} requires an argument\n400 unable to parse option")
            else:
                value, i = nxt, i + 1
        opts[name] = _convert(name, kind, value)
    return _assign(free, positionals), opts


def _convert(name: str, kind: str, value: str) -> object:
    if kind == "bool":
        low = value.lower()
        if low in TRUE | FALSE:
            return 1 if low in TRUE else 0
        raise ParseError(f"400 Parameter verification failed.\n{name}: type check ('boolean') "
                         f"failed - got '{value}'")
    if kind == "int" and not re.fullmatch(r"-?\d+", value):
        raise ParseError(f"400 Parameter verification failed.\n{name}: type check ('integer') "
                         f"failed - got '{value}'")
    return int(value) if kind == "int" else value


def _assign(free: list[str], names: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for idx, name in enumerate(names):
        if name.endswith("*"):
            out[name[:-1]] = free[idx:]
            return out
        if idx >= len(free):
            raise ParseError("400 not enough arguments")
        out[name] = free[idx]
    if len(free) > len(names):
        raise ParseError("400 too many arguments")
    return out


def check_vmid(text: str) -> int:
    """Raises ParseError like pct for a malformed vmid (valid: 100..999999999)."""
    if not re.fullmatch(r"[1-9]\d{2,8}", text):
        raise ParseError("400 Parameter verification failed.\nvmid: invalid format - value "
                         "does not look like a valid VM ID")
    return int(text)
