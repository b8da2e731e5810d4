"""What ``smb status`` shows: the controller's view of the cluster, each memory server's
own counters (its ``Stats`` call), the gRPC health of every daemon and, on request,
operation latencies read from each memory server's Prometheus ``/metrics``.

:func:`gather` collects a plain dict (what ``smb status --json`` prints);
:func:`render` turns it into the tables of ``smb status``.
"""
from __future__ import annotations

import logging
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from smb_client import Client
from smb_protocol import errors, rpc
from smb_protocol._proto.smb.v1 import memory_server_pb2, memory_server_pb2_grpc
from smb_protocol.addressing import format_hostport, parse_hostport
from smb_protocol.latency import SERVER_HISTOGRAM
from smb_protocol.units import format_bytes
from smb_server.runtime import health
from smb_server.runtime.metrics import histogram_quantile, parse

log = logging.getLogger(__name__)

CALL_TIMEOUT = 2.0        # seconds per memory-server call (Stats, health, /metrics)
LATENCY_METRIC = SERVER_HISTOGRAM
QUANTILES = (0.5, 0.99)
NO_METRICS = ("no memory server serves /metrics, so there are no latencies to show; set "
              "metrics_port on the servers (--metrics-port, SMB_METRICS_PORT), or start a local "
              "cluster with `smb up --metrics`")


def serves_metrics(status: dict[str, Any]) -> bool:
    """Whether any memory server of a :func:`gather` report (with ``metrics``) was read."""
    return any("metrics_url" in s for s in status["servers"])


def gather(client: Client, metrics: bool = False, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
    """The cluster as the controller and every reachable memory server report it.

    ``metrics``: also scrape each server's ``/metrics`` for operation latencies. Servers
    that are down are not called; one that does not answer gets ``"health":
    "UNREACHABLE"`` and no counters. Raises ControllerUnavailable (and other typed
    errors) from the controller calls only.
    """
    servers, regions = client.list_servers(), client.list_regions()
    now = time.time()
    rows = [{"server_id": s.server_id, "state": s.state, "address": s.grpc_address,
             "capacity_bytes": s.capacity, "used_bytes": s.used, "extents": s.extents,
             "evacuating": s.evacuating, "moved_bytes": s.moved_bytes, "move_rate": s.move_rate,
             "transports": [u.partition(":")[0] for u in s.endpoints],
             "heartbeat_age_seconds": round(now - s.last_heartbeat, 3) if s.last_heartbeat else None}
            for s in servers]
    with ThreadPoolExecutor(max(1, min(16, len(rows)))) as pool:
        for row, extra in zip(rows, pool.map(lambda r: _ask_server(r, client.token, metrics, timeout), rows),
                              strict=True):
            row.update(extra)
    # of a list of controllers (one etcd store), the one that answered leads
    controllers = [{"address": a, "health": health.check(a, timeout=timeout),
                    "role": "leader" if a == client.controller else "standby"}
                   for a in client.controllers]
    for c in controllers:
        if c["health"] == "UNREACHABLE":
            c["role"] = "unreachable"
    return {
        "controller": controllers[client.controllers.index(client.controller)],
        "controllers": controllers,
        "servers": rows,
        "regions": [region_row(r) for r in regions],
    }


def _ask_server(row: dict[str, Any], token: str, metrics: bool, timeout: float) -> dict[str, Any]:
    if row["state"] == "down":
        return {"health": "-"}
    out: dict[str, Any] = {"health": health.check(row["address"], timeout=timeout)}
    if out["health"] == "UNREACHABLE":
        return out
    channel = rpc.channel(row["address"])
    try:
        stub = memory_server_pb2_grpc.MemoryServerStub(channel)  # type: ignore[no-untyped-call]  # generated stub, untyped __init__
        st = rpc.call(stub.Stats, memory_server_pb2.StatsRequest(), token, timeout, errors.ServerUnavailable)
    except errors.SMBError as exc:
        log.debug("Stats of %s: %s", row["address"], exc)
        return out
    finally:
        channel.close()
    out.update(sessions=st.sessions, bytes_read=st.bytes_read, bytes_written=st.bytes_written,
               bytes_accumulated=st.bytes_accumulated, operations=st.operations, errors=st.errors,
               resident_bytes=st.rss_bytes, metrics_port=st.metrics_port)
    if metrics and st.metrics_port:
        host = parse_hostport(row["address"])[0]
        out["metrics_url"] = f"http://{format_hostport(host, st.metrics_port)}/metrics"
        out["latency_seconds"] = scrape_latency(out["metrics_url"], timeout)
    return out


def scrape_latency(url: str, timeout: float = CALL_TIMEOUT) -> list[dict[str, Any]] | None:
    """Per (op, transport): count and the :data:`QUANTILES` of the server's operation
    latency (seconds), from its ``/metrics``; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode()
        samples = parse(text)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        log.debug("scraping %s: %s", url, exc)
        return None
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in samples:
        if s.name == LATENCY_METRIC + "_bucket":
            key = (s.labels.get("op", ""), s.labels.get("transport", ""))
            buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
    out = []
    for (op, transport), b in sorted(buckets.items()):
        count = max(v for _, v in b)
        entry: dict[str, Any] = {"op": op, "transport": transport, "count": int(count)}
        for q in QUANTILES:
            value = histogram_quantile(q, b)
            entry[f"p{round(q * 100)}"] = None if math.isnan(value) else value
        out.append(entry)
    return out


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e6:.0f}us" if value < 1e-3 else f"{value * 1e3:.1f}ms"


def render(status: dict[str, Any], metrics: bool = False) -> str:
    """The text tables of ``smb status``; ``metrics``: latencies were asked for (a
    hint, not an empty table, when no server serves them)."""
    ctl = status["controller"]
    controllers = status.get("controllers") or [ctl]
    if len(controllers) == 1:
        lines = [f"controller {ctl['address']}: {ctl['health']}", ""]
    else:
        lines = [f"controller {c['address']}: {c['health']} ({c['role']})" for c in controllers] + [""]
    servers = status["servers"]
    lines.append(f"servers ({len(servers)}):")
    rows = []
    for s in servers:
        age = s["heartbeat_age_seconds"]
        rows.append([s["server_id"], s["state"], s["health"], s["address"], format_bytes(s["capacity_bytes"]),
                     format_bytes(s["used_bytes"]), str(s["extents"]), ",".join(s["transports"]),
                     f"{age:.1f}s" if age is not None else "-", str(s.get("sessions", "-")),
                     _io(s), str(s.get("errors", "-"))])
    lines.append(_table(rows, ["ID", "STATE", "HEALTH", "ADDRESS", "CAPACITY", "USED", "EXTENTS",
                               "TRANSPORTS", "HEARTBEAT", "SESSIONS", "READ/WRITTEN/ACCUMULATED",
                               "ERRORS"]))
    draining = [s["server_id"] for s in servers if s["state"] == "draining" and not s.get("evacuating")]
    if draining:
        lines.append(f"draining (no new extents): {', '.join(draining)}")
    for s in servers:
        if s.get("evacuating"):
            lines.append(f"evacuating {s['server_id']}: {format_bytes(s['moved_bytes'])} moved, "
                         f"{format_bytes(s['used_bytes'])} in {s['extents']} extent(s) left, "
                         f"{format_bytes(int(s['move_rate']))}/s")
    latency = [(s["server_id"], e) for s in servers for e in (s.get("latency_seconds") or [])]
    if metrics and not serves_metrics(status):
        lines += ["", NO_METRICS]
    elif metrics and not latency:
        lines += ["", "operation latency: no operation served yet (the memory servers' /metrics "
                      "count data-plane requests)"]
    elif serves_metrics(status):
        lines += ["", "operation latency (server side, from /metrics):"]
        lines.append(_table([[sid, e["op"], e["transport"], str(e["count"]), _seconds(e["p50"]),
                              _seconds(e["p99"])] for sid, e in latency],
                            ["SERVER", "OP", "TRANSPORT", "COUNT", "P50", "P99"]))
    regions = status["regions"]
    lines += ["", f"regions ({len(regions)}):"]
    lines.append(region_table(regions))
    degraded = [r["name"] for r in regions if r["state"] == "degraded"]
    if degraded:
        lines.append(f"degraded (a copy is missing or being repaired, data still served): "
                     f"{', '.join(degraded)}")
    lost = [r["name"] for r in regions if r["state"] == "lost"]
    if lost:
        lines.append(f"lost (some bytes have no copy; delete and recreate): {', '.join(lost)}")
    return "\n".join(lines)


def region_row(r: Any) -> dict[str, Any]:
    """A region as ``smb status --json`` prints it (``r``: a RegionInfo)."""
    return {"name": r.name, "size_bytes": r.size, "placement": r.placement, "state": r.state,
            "persistent": r.persistent, "servers": list(r.servers),
            "replicas": int(getattr(r, "replicas", 1) or 1),
            "copy_servers": list(getattr(r, "copy_servers", ()))}


def region_table(regions: list[dict[str, Any]]) -> str:
    """The regions table of ``smb status`` and ``smb region ls``, sizes readable;
    SERVERS lists the primaries' servers, then ``+`` the other copies' servers."""
    def servers(r: dict[str, Any]) -> str:
        others = sorted(set(r.get("copy_servers", ())))
        return ",".join(r["servers"]) + (f" +{','.join(others)}" if others else "")
    return _table([[r["name"], format_bytes(r["size_bytes"]), r["placement"], str(r.get("replicas", 1)),
                    r["state"], servers(r)] for r in regions],
                  ["NAME", "SIZE", "PLACEMENT", "REPLICAS", "STATE", "SERVERS"])


def _io(s: dict[str, Any]) -> str:
    if "bytes_read" not in s:
        return "-"
    return "/".join(format_bytes(s[k]) for k in ("bytes_read", "bytes_written", "bytes_accumulated"))
