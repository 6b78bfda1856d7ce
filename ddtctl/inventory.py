"""Load inventory.yaml, report errors as `FILE:LINE: key.path: message`, resolve and select hosts.

The YAML is composed into a node tree first (`yaml.compose`) so that every pydantic error location
can be mapped back to the line of the key or value it concerns. Cross references (a container on
an undefined node, a group naming an unknown host, a name used twice) are checked here with the
same reporting. Selection turns command-line words (host names, group names, node names, globs,
`--all`, `--limit`) into an ordered list of `Host`s and refuses an empty selection.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Sequence

import yaml
from pydantic import ValidationError

from ddtctl.errors import InventoryError, UsageError
from ddtctl import inventory_refs as refs
from ddtctl.inventory_files import DEFAULT_INVENTORY, ddtctl_home, inventory_candidates, inventory_path
from ddtctl.inventory_schema import Host, InventoryModel
from ddtctl.inventory_values import string_problem

__all__ = ["DEFAULT_INVENTORY", "Host", "Inventory", "Issue", "ddtctl_home", "inventory_candidates", "inventory_path",
           "load_inventory", "parse_inventory"]

@dataclass(frozen=True)
class Issue:
    """One problem in the inventory: 1-based line (0 = unknown), dotted key path, message."""

    line: int
    path: str
    message: str


@dataclass
class Inventory:
    """A validated inventory: hosts by name (containers first, then local hosts) and groups."""

    path: Path
    model: InventoryModel
    hosts: dict[str, Host] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)

    def select(self, words: Sequence[str] = (), *, all_hosts: bool = False,
               limit: str | None = None) -> list[Host]:
        """Hosts named by `words` (host, group or node names, or globs) or `all_hosts`.

        `limit` (a glob or comma list) narrows the result. Raises UsageError for unknown words
        and for an empty selection.
        """
        if not words and not all_hosts:
            raise UsageError("name a HOST or group, or pass --all "
                             f"(hosts: {', '.join(self.hosts) or 'none'})")
        chosen: list[str] = list(self.hosts) if all_hosts else []
        for word in words:
            chosen.extend(self._expand(word))
        if limit:
            pats = [p.strip() for p in limit.split(",") if p.strip()]
            chosen = [n for n in chosen if any(fnmatch.fnmatchcase(n, p) or n in self.groups.get(p, ())
                                               for p in pats)]
        names = list(dict.fromkeys(chosen))
        if not names:
            raise UsageError("no hosts selected" + (f" (--limit {limit!r} matched none)" if limit else ""))
        return [self.hosts[n] for n in names]

    def _expand(self, word: str) -> list[str]:
        if word in self.hosts:
            return [word]
        if word in self.groups:
            return list(self.groups[word])
        if any(c in word for c in "*?["):
            hits = [n for n in self.hosts if fnmatch.fnmatchcase(n, word)]
            if hits:
                return hits
        near = difflib.get_close_matches(word, [*self.hosts, *self.groups], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise UsageError(f"unknown host or group {word!r}{hint} (see `ddtctl inventory`)")


# ----------------------------------------------------------------------------- loading

def load_inventory(path: str | os.PathLike | None = None) -> Inventory:
    """Read and validate an inventory file.

    Raises InventoryError (exit code 2) listing every issue as `FILE:LINE: key.path: message`.
    """
    file = inventory_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        looked = "" if path or os.environ.get("DDTCTL_INVENTORY") else (
            "; looked for inventory.yaml in this directory and its parents, "
            f"{inventory_candidates()[-2]} and {inventory_candidates()[-1]}")
        raise InventoryError(f"{file}: cannot read inventory: {exc.strerror or exc} "
                             f"(pass --inventory FILE or set DDTCTL_INVENTORY{looked})") from None
    except UnicodeDecodeError as exc:
        line = file.read_bytes()[:exc.start].count(b"\n") + 1
        raise InventoryError(f"{file}: cannot read inventory: not UTF-8 (line {line}, byte "
                             f"{exc.start}: {exc.object[exc.start:exc.start + 1]!r})") from None
    return parse_inventory(text, file)


def parse_inventory(text: str, file: Path) -> Inventory:
    """Validate inventory YAML `text` (named `file` in messages); see `load_inventory`.

    One pass reports everything: YAML duplicate keys and unusable strings, schema errors of every
    entry, cross references (names, nodes, vmids, ports, group members, shared model paths) and
    per-host service problems, sorted by line.
    """
    root, data = _compose(text, file)
    issues = _duplicate_keys(root) + _bad_strings(root)
    model = None
    try:
        model = InventoryModel.model_validate(data)
    except ValidationError as exc:
        issues += [_issue_from_error(root, err) for err in exc.errors()]
    hosts, problems = refs.valid_hosts(data, ddtctl_home())
    problems += refs.cross_references(data, hosts)
    hosts, more = refs.resolve_packages(data, hosts)
    problems += more
    issues += [Issue(_line_of(root, loc), _dotted(loc), message) for loc, message in problems]
    if not issues and model is not None:
        return Inventory(file, model, hosts, refs.groups_of(model, hosts))
    _fail(file, _first_per_key(issues))


def _compose(text: str, file: Path) -> tuple[yaml.Node | None, Any]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.SafeLoader("").construct_document(root) if root is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 0
        _fail(file, [Issue(line, "", f"invalid YAML: {exc.problem}")])
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(file, [Issue(1, "", "the top level must be a mapping")])
    return root, data


def format_issue(file: Path, issue: Issue) -> str:
    """`FILE:LINE: key.path: message` (the line or path part is left out when unknown)."""
    where = f"{file}:{issue.line}" if issue.line else str(file)
    return f"{where}: {issue.path}: {issue.message}" if issue.path else f"{where}: {issue.message}"


def _first_per_key(issues: list[Issue]) -> list[Issue]:
    """One issue per (line, key path, message); a NUL or surrogate string hides the schema's
    complaint about the same value."""
    out, seen_bad = [], {(i.line, i.path) for i in issues if i.message.startswith(_BAD_STRING)}
    for issue in dict.fromkeys(issues):
        if (issue.line, issue.path) in seen_bad and not issue.message.startswith(_BAD_STRING):
            continue
        out.append(issue)
    return out


def _fail(file: Path, issues: list[Issue]) -> NoReturn:
    issues = sorted(issues, key=lambda i: (i.line, i.path))
    err = InventoryError("\n".join(format_issue(file, i) for i in issues))
    err.issues = issues
    raise err


def _duplicate_keys(node: yaml.Node | None, prefix: tuple = ()) -> list[Issue]:
    issues: list[Issue] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value
            if name in seen:
                issues.append(Issue(key.start_mark.line + 1, _dotted((*prefix, name)),
                                    f"duplicate key (first defined on line {seen[name]})"))
            else:
                seen[name] = key.start_mark.line + 1
            issues += _duplicate_keys(value, (*prefix, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += _duplicate_keys(item, (*prefix, i))
    return issues


_BAD_STRING = "unusable string: "


def _bad_strings(node: yaml.Node | None, prefix: tuple = ()) -> list[Issue]:
    """Scalars (keys included) holding NUL or a lone surrogate (inventory_values.string_problem)."""
    issues: list[Issue] = []
    if isinstance(node, yaml.ScalarNode):
        problem = string_problem(node.value)
        if problem:
            issues.append(Issue(node.start_mark.line + 1, _dotted(prefix), _BAD_STRING + problem))
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            issues += _bad_strings(key, prefix) + _bad_strings(value, (*prefix, key.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            issues += _bad_strings(item, (*prefix, i))
    return issues


def _line_of(root: yaml.Node | None, loc: Sequence) -> int:
    node, _ = _node_at(root, loc, want_key=True)
    return node.start_mark.line + 1 if node is not None else 0


def _node_at(root: yaml.Node | None, loc: Sequence, *, want_key: bool = False) -> tuple[yaml.Node | None, tuple]:
    """Walk `loc` down the YAML tree: (deepest node reached, the part of `loc` actually found).

    A discriminated-union tag in `loc` (the service `kind`) is skipped. With `want_key`, a fully
    found location ending at a mapping key returns the key node (for "unknown key" errors).
    """
    node, found, key_node, complete = root, (), None, True
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            if not match:
                if any(k.value == "kind" and v.value == part for k, v in node.value):
                    continue
                complete = False
                break
            key_node, node = match[-1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            key_node, node = None, node.value[part]
        else:
            complete = False
            break
        found = (*found, part)
    if want_key and complete and key_node is not None:
        return key_node, found
    return node, found


def _key_issue(root: yaml.Node | None, loc: tuple, value: Any) -> Issue:
    """A key YAML read as a boolean or number (`yes:`, `200:`; pydantic's loc ends (key, "[key]"))."""
    parent, found = _node_at(root, loc[:-2])
    line, text = (parent.start_mark.line + 1 if parent is not None else 0), str(value)
    for key, _ in parent.value if isinstance(parent, yaml.MappingNode) else ():
        built = yaml.SafeLoader("").construct_object(key) if isinstance(key, yaml.ScalarNode) else None
        if type(built) is type(value) and built == value:
            line, text = key.start_mark.line + 1, key.value
    what = f"the boolean {str(value).lower()}" if isinstance(value, bool) else "a number"
    return Issue(line, _dotted((*(p for p in loc[:-2] if p in found or p not in _TAGS), text)),
                 f"names must be strings: YAML reads `{text}` as {what}; quote it (\"{text}\")")


def _issue_from_error(root: yaml.Node | None, err: dict) -> Issue:
    loc = tuple(err["loc"])
    if loc and loc[-1] == "[key]" and isinstance(err.get("input"), (bool, int, float)):
        return _key_issue(root, loc, err["input"])
    if loc and loc[-1] == "[key]":               # a key with a bad name: the mapping's path, the key's line
        node, found = _node_at(root, loc[:-1], want_key=True)
        shown = tuple(p for p in loc[:-2] if p in found or not isinstance(p, str) or p not in _TAGS)
        return Issue(node.start_mark.line + 1 if node is not None else 0, _dotted(shown),
                     f"{err['input']!r} {_plain_message(err)}")
    if err["type"] == "missing":                 # point at the key of the mapping that lacks it
        node, found = _node_at(root, loc[:-1], want_key=True)
        found = (*found, loc[-1])
    elif err["type"].startswith("union_tag"):    # point at `kind:`
        node, found = _node_at(root, (*loc, "kind"))
        found = loc
    else:
        node, found = _node_at(root, loc, want_key=err["type"] == "extra_forbidden")
    line = node.start_mark.line + 1 if node is not None else 0
    shown = tuple(p for p in loc if p in found or not isinstance(p, str) or p not in _TAGS)
    msg = _plain_message(err)
    msg = {"extra_forbidden": "unknown key", "missing": "required key is missing",
           "union_tag_invalid": "kind must be one of ddtree, sglang, vllm",
           "union_tag_not_found": "`kind:` is missing (ddtree, sglang or vllm)"}.get(err["type"], msg)
    if isinstance(err.get("input"), bool):       # YAML true/false/yes/no where a number belongs
        msg = f"{msg}, not the boolean {str(err['input']).lower()}"
    elif err["type"] in ("int_type", "float_type") and isinstance(err.get("input"), str):
        msg = f"{msg}, not the string {err['input']!r}"
    return Issue(line, _dotted(shown), msg)


_TAGS = ("ddtree", "sglang", "vllm")


def _plain_message(err: dict) -> str:
    """pydantic's message without its "Value error, " / "Assertion failed, " prefix."""
    if err["type"] in ("value_error", "assertion_error") and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    return err["msg"]


def _dotted(loc: Sequence) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
