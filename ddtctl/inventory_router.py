"""Routers of the inventory: each `kind: router` service gets the services of its `backends` group.

Pure bookkeeping on the parsed YAML and the resolved hosts (like ddtctl.inventory_refs): the group
must exist and hold at least one service that is not a router; all of them must serve one model id
(a router sends a request to any of them), which is also the router's unless it sets `model_id`
to the same value. Problems come back as `(key path, message)` for file/line mapping.
"""

from __future__ import annotations

from dataclasses import replace

from ddtctl.inventory_refs import mapping_of
from ddtctl.inventory_schema import Backend, Host

Problem = tuple[tuple, str]


def group_members(data: dict, hosts: dict[str, Host]) -> dict[str, list[str]]:
    """group -> host names: `groups:` lists, per-host `groups:`, and one group per node."""
    members: dict[str, list[str]] = {}
    for gname, names in mapping_of(data, "groups").items():
        if isinstance(names, list):
            members.setdefault(gname, []).extend(n for n in names if isinstance(n, str) and n in hosts)
    for name, host in hosts.items():
        for gname in (*host.groups, *([host.node_name] if host.node_name else [])):
            members.setdefault(gname, []).append(name)
    return {g: list(dict.fromkeys(m)) for g, m in members.items()}


def resolve_routers(data: dict, hosts: dict[str, Host]) -> tuple[dict[str, Host], list[Problem]]:
    """Every router host with its `backends` resolved; the problems of routers that cannot work."""
    members = group_members(data, hosts)
    problems: list[Problem] = []
    out = dict(hosts)
    for name, host in hosts.items():
        svc = host.service
        if svc.kind != "router":
            continue
        where = (host.section, name, "service", "backends")
        group = svc.backends
        if group not in members and group not in mapping_of(data, "groups"):
            problems.append((where, f"unknown group {group!r} (a group or node name under which the "
                             "backend services are listed)"))
            continue
        names = [n for n in members.get(group, []) if n != name]
        routers = [n for n in names if hosts[n].service.kind == "router"]
        if name in members.get(group, []):
            problems.append((where, f"group {group!r} contains the router {name!r} itself"))
        if routers:
            problems.append((where, f"group {group!r} contains the router(s) {', '.join(routers)}; "
                             "a router sends requests to serving backends only"))
        names = [n for n in names if n not in routers]
        if not names:
            problems.append((where, f"group {group!r} has no backend service"))
            continue
        ids = {hosts[n].model_id for n in names}
        if len(ids) > 1:
            shown = ", ".join(f"{n}: {hosts[n].model_id}" for n in names)
            problems.append((where, f"the backends of group {group!r} serve different model ids ({shown}); "
                             "a router needs one model id (set service.model_id alike)"))
            continue
        model_id = ids.pop()
        if svc.model_id and svc.model_id != model_id:
            problems.append(((host.section, name, "service", "model_id"), f"{svc.model_id!r} differs from "
                             f"the model id its backends serve ({model_id!r}); remove it or make it equal"))
            continue
        backends = tuple(Backend(n, hosts[n].service.kind, hosts[n].address, hosts[n].service.port, model_id)
                         for n in names)
        out[name] = replace(host, backends=backends,
                            service=svc if svc.model_id else svc.model_copy(update={"model_id": model_id}))
    return out, problems
