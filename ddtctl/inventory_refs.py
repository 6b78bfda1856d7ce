"""Inventory checks beyond the schema: hosts of the entries that validate, cross references, groups.

Pure bookkeeping on the parsed YAML (`data`, plain dicts and lists) and on `Host`s: every check
returns `(key path, message)` problems, which `ddtctl.inventory` maps to file lines. Cross
references run on the raw data, so they are reported even for entries with schema errors.
"""

from __future__ import annotations

import difflib
import os
import posixpath
from dataclasses import replace
from pathlib import Path

from pydantic import ValidationError

from ddtctl.inventory_schema import (HOST_NAME, Container, Host, InventoryModel, LocalHost, Node,
                                     Packages, PackageSettings)
from ddtctl.inventory_values import install_root_problem

Problem = tuple[tuple, str]      # (key path, message)


def mapping_of(data: dict, name: str) -> dict:
    value = data.get(name)
    return {k: v for k, v in value.items() if isinstance(k, str)} if isinstance(value, dict) else {}


def valid_hosts(data: dict, home: Path) -> tuple[dict[str, Host], list[Problem]]:
    """Hosts of every container/local entry that validates on its own (the others are already
    reported by the schema), and the problems of those hosts' settings."""
    nodes = mapping_of(data, "nodes")
    hosts: dict[str, Host] = {}
    problems: list[Problem] = []
    for name, raw in mapping_of(data, "containers").items():
        try:
            ct = Container.model_validate(raw)
        except ValidationError:
            continue
        try:
            node = Node.model_validate(nodes[ct.node]) if ct.node in nodes else None
        except ValidationError:
            node = None
        hosts[name] = Host.of_container(name, ct, node)
    for name, raw in mapping_of(data, "local").items():
        try:
            lh = LocalHost.model_validate(raw)
        except ValidationError:
            continue
        host = Host.of_local(name, lh, str(home / "hosts" / name))
        # an explicit root is checked as written (after ~ expansion): normalising first would
        # resolve `..` (/tmp/../etc -> /etc) instead of refusing it as for containers
        shown = os.path.expanduser(lh.root) if lh.root else host.root
        problem = install_root_problem(shown)
        if problem:
            where = ("local", name, "root") if lh.root else ("local", name)
            what = "root" if lh.root else "the default root ($DDTCTL_HOME/hosts/<name>)"
            problems.append((where, f"{what} {shown} {problem}"))
            continue
        hosts[name] = host
    for name, host in hosts.items():
        problems += [((host.section, name, "service", *sub), message) for sub, message in host.service_problems()]
    return hosts, problems


def cross_references(data: dict, hosts: dict[str, Host]) -> list[Problem]:
    """Names, nodes, vmids, endpoints, group members and shared model paths, on the raw data
    (so that they are checked even where an entry has schema errors)."""
    problems: list[Problem] = []
    sections = {name: mapping_of(data, name) for name in ("nodes", "containers", "local", "groups")}
    host_names = {*sections["containers"], *sections["local"]}
    if not host_names:
        problems.append(((), "the inventory defines no hosts: add one under `containers:` or `local:`"))
    seen: dict[str, str] = {}
    for section, entries in sections.items():
        for name in entries:
            if not HOST_NAME.match(name):
                problems.append(((section, name), "names use letters, digits, '_', '.', '-' and start "
                                 "with a letter or digit"))
            if name in seen and not (section == "groups" and seen[name] == "nodes"):
                problems.append(((section, name), f"name already used under {seen[name]}:"))
            seen.setdefault(name, section)
    problems += _container_references(sections["nodes"], sections["containers"])
    problems += _endpoint_references(sections["containers"], sections["local"])
    for gname, members in sections["groups"].items():
        for i, member in enumerate(members if isinstance(members, list) else []):
            if isinstance(member, str) and member not in host_names:
                near = difflib.get_close_matches(member, sorted(host_names), n=1)
                problems.append((("groups", gname, i), f"unknown host {member!r}"
                                 + (f"; did you mean {near[0]!r}?" if near else "")))
    for section in ("containers", "local"):
        for name, entry in sections[section].items():
            groups = entry.get("groups") if isinstance(entry, dict) else None
            for gname in groups if isinstance(groups, list) else []:
                if isinstance(gname, str) and gname in host_names:
                    problems.append(((section, name, "groups"), f"group {gname!r} has the name of a host"))
    return problems + _shared_paths(hosts)


def _container_references(nodes: dict, containers: dict) -> list[Problem]:
    problems: list[Problem] = []
    vmids: dict[tuple[str, int], str] = {}
    for name, ct in containers.items():
        if not isinstance(ct, dict):
            continue
        node, vmid = ct.get("node"), ct.get("vmid")
        if isinstance(node, str) and node and node not in nodes:
            near = difflib.get_close_matches(node, list(nodes), n=1)
            problems.append(((("containers", name, "node")), f"undefined node {node!r}"
                             + (f"; did you mean {near[0]!r}?" if near else f" (nodes: {', '.join(nodes) or 'none'})")))
        if isinstance(node, str) and type(vmid) is int:
            key = (node, vmid)
            if key in vmids:
                problems.append((("containers", name, "vmid"), f"vmid {vmid} already used by {vmids[key]} on node {node}"))
            vmids.setdefault(key, name)
    return problems


def _endpoint_references(containers: dict, local: dict) -> list[Problem]:
    """The same endpoint twice: two local hosts on one port, or two containers of one node with
    the same address and port (containers with their own addresses may share a port number)."""
    problems: list[Problem] = []
    ports: dict[tuple, str] = {}
    for section, entries in (("containers", containers), ("local", local)):
        for name, entry in entries.items():
            service = entry.get("service") if isinstance(entry, dict) else None
            port = service.get("port") if isinstance(service, dict) else None
            if type(port) is not int:
                continue
            key = ((entry.get("node"), entry.get("address"), port) if section == "containers" else ("local", port))
            if section == "containers" and not all(isinstance(k, str) for k in key[:2]):
                continue
            if key in ports:
                where = "on this machine" if section == "local" else f"at {key[1]} on node {key[0]}"
                problems.append(((section, name, "service", "port"), f"port {port} already used by {ports[key]} {where}"))
            ports.setdefault(key, name)
    return problems


def _shared_paths(hosts: dict[str, Host]) -> list[Problem]:
    """Two `weights: shared` models of one node that map to the same node folder
    (`<models_root>/<base name of path>`) but come from different sources."""
    problems: list[Problem] = []
    used: dict[tuple[str, str], tuple[str, str, str]] = {}
    for name, host in hosts.items():
        svc = host.service
        if host.kind != "container" or svc.weights != "shared" or host.node is None:
            continue
        for which in ("target", "drafter"):
            ref = getattr(svc, which)
            if ref is None or not ref.source:
                continue
            node_path = posixpath.join(host.node.models_root, posixpath.basename(ref.path))
            source = os.path.expanduser(ref.source)
            key = (host.node_name, node_path)
            other = used.setdefault(key, (source, name, which))
            if other[0] != source:
                problems.append((("containers", name, "service", which, "source"),
                                 f"shared models of node {host.node_name} go to {node_path}, which "
                                 f"{other[1]}.service.{other[2]} fills from {other[0]}; give one of them "
                                 "another base name"))
    return problems


def groups_of(model: InventoryModel, hosts: dict[str, Host]) -> dict[str, list[str]]:
    """group -> member host names: `groups:` lists, per-host `groups:`, and one group per node."""
    groups: dict[str, list[str]] = {}
    for gname, members in model.groups.items():
        groups.setdefault(gname, []).extend(m for m in members if m in hosts)
    for name, host in hosts.items():
        for gname in host.groups:
            groups.setdefault(gname, []).append(name)
        if host.node_name:
            groups.setdefault(host.node_name, []).append(name)
    return {g: list(dict.fromkeys(m)) for g, m in groups.items()}


def resolve_packages(data: dict, hosts: dict[str, Host]) -> tuple[dict[str, Host], list[Problem]]:
    """Each ddtree and router host with its `PackageSettings`: the default (`index` for containers, `system`
    for local hosts), then `packages: {all: ...}`, then the `packages:` of its groups, then its
    own `service.packages`; a key two of its groups set differently (and the host does not) is a
    problem."""
    problems: list[Problem] = []
    members: dict[str, set[str]] = {}
    for gname, names in mapping_of(data, "groups").items():
        if isinstance(names, list):
            members.setdefault(gname, set()).update(n for n in names if isinstance(n, str))
    for name, host in hosts.items():
        for gname in (*host.groups, *([host.node_name] if host.node_name else [])):
            members.setdefault(gname, set()).add(name)
    entries: dict[str, Packages] = {}
    for gname, value in mapping_of(data, "packages").items():
        if gname != "all" and gname not in members and gname not in mapping_of(data, "groups"):
            problems.append((("packages", gname), f"unknown group {gname!r} (a group, a node name, or `all`)"))
        try:
            entries[gname] = Packages.model_validate(value)
        except ValidationError:
            continue                                  # reported by the schema
    out: dict[str, Host] = {}
    for name, host in hosts.items():
        if host.service.kind not in ("ddtree", "router"):
            out[name] = host
            continue
        values: dict = {"mode": "index" if host.kind == "container" else "system"}
        own = host.service.packages
        own_keys = own.model_fields_set if own is not None else set()
        if "all" in entries:
            values.update({k: getattr(entries["all"], k) for k in entries["all"].model_fields_set})
        chosen: dict[str, tuple[str, object]] = {}
        for gname, entry in entries.items():
            if gname == "all" or name not in members.get(gname, ()):
                continue
            for key in sorted(entry.model_fields_set):
                value = getattr(entry, key)
                if key in chosen and chosen[key][1] != value and key not in own_keys:
                    problems.append(((host.section, name, "groups"), f"packages.{key} is set differently by "
                                     f"groups {chosen[key][0]!r} and {gname!r}; set it in the host's "
                                     "service.packages or in one group"))
                chosen.setdefault(key, (gname, value))
        values.update({k: v for k, (_, v) in chosen.items()})
        values.update({k: getattr(own, k) for k in own_keys})
        settings = PackageSettings(**{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in values.items() if v is not None})
        out[name] = replace(host, packages=settings)
    return out, problems
