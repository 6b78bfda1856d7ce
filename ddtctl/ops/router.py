"""What ddtctl reads from a router (sglang-router) and from its backends, over HTTP.

* the router's own readiness: `GET /readiness` is 200 while at least one backend is healthy
  (503 `{"status": "not ready", "reason": "insufficient healthy workers"}` otherwise); its `/health`
  is 200 whenever the process runs (liveness only);
* its view of the backends: `GET /workers` lists each worker URL with `is_healthy` (the result of
  the router's own health checks at the backend's readiness path);
* each backend directly (`backend_states`): its readiness path through the router host's node, so
  `status` shows a backend the router cannot see as well as one it marks unhealthy.
The router's `/v1/models` lists the model as `unknown` for non-SGLang workers, so the model id is
checked on the backends and by a completion through the router, not in that list.
"""

from __future__ import annotations

import httpx

from ddtctl.inventory import Host

READINESS = "/readiness"


def workers(client: httpx.Client, host: Host) -> dict[str, bool | None]:
    """backend name -> the router's verdict (True healthy, False unhealthy, None not registered).
    Raises httpx.HTTPError / ValueError when /workers cannot be read."""
    r = client.get("/workers")
    r.raise_for_status()
    seen = {w.get("url", "").rstrip("/"): bool(w.get("is_healthy")) for w in r.json().get("workers", [])}
    return {b.name: seen.get(b.base_url) for b in host.backends}


def describe(verdicts: dict[str, bool | None]) -> str:
    """`2/3 backends healthy (ct202 unhealthy)` from `workers`' answer."""
    healthy = sum(v is True for v in verdicts.values())
    bad = [f"{n} {'unhealthy' if v is False else 'not registered'}" for n, v in verdicts.items() if v is not True]
    return f"{healthy}/{len(verdicts)} backends healthy" + (f" ({', '.join(bad)})" if bad else "")


def backend_states(host: Host, transport, *, timeout: float = 5.0) -> list[dict]:
    """Each backend's readiness as the router's node reaches it: {name, url, ready, detail}."""
    out = []
    for b in host.backends:
        item = {"name": b.name, "url": b.base_url, "ready": False, "detail": ""}
        try:
            with transport.forward(b.address, b.port) as (addr, port):
                base = f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}"
                r = httpx.get(base + b.health_path, timeout=httpx.Timeout(timeout, connect=timeout))
            item["ready"] = r.status_code == 200
            item["detail"] = f"{b.health_path} {r.status_code}"
        except httpx.HTTPError as exc:
            item["detail"] = f"unreachable ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001 - the node's forward failed: report, go on
            item["detail"] = f"unreachable ({str(exc).splitlines()[0][:120]})"
        out.append(item)
    return out
