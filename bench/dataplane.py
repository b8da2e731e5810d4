"""TCP and shm data-plane throughput against references measured in the same run.

    .venv/bin/python bench/dataplane.py                  # make bench
    .venv/bin/python bench/dataplane.py --quick          # fewer sizes, shorter points
    .venv/bin/python bench/dataplane.py --transports tcp,tcp+tls   # TLS against plain tcp only

A local cluster (controller + two memory servers, separate processes on loopback) and,
for every operation size from 4 KiB to 64 MiB:

* ``Region.write`` / ``Region.read_into`` over tcp and shm, on a region striped over one
  and over two memory servers (1 MiB stripe unit);
* the same over tcp with TLS (``tcp+tls``), on a second local cluster made with a
  throw-away CA (``smb up --tls``), and as its reference the raw socket pair over TLS
  (Python's ``ssl``, same certificates); the ratios TLS / plain tcp and TLS / raw TLS
  socket are reported;
* references, each in its own server process like the memory server:
  a raw TCP socket pair on loopback (``sendall`` / ``recv_into``, one connection, a
  one-byte acknowledgement per write, a 16-byte request per read), ``numpy.copyto``
  (memcpy) in this process, and gRPC unary calls carrying the same bytes.

Each point is the best of ``--repeats`` runs, each run at least ``--seconds`` long.
Throughput is bytes / seconds in MB/s (1e6 bytes). Results go to
``bench/results/dataplane.json``, ``docs/img/dataplane.png`` and a Markdown table in
``bench/results/dataplane.md`` (pasted into ``docs/benchmarks.md``).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import struct
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.throughput import arguments, machine, save, timed  # noqa: E402
from smb_protocol.units import format_bytes  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402
from smb_server.runtime.certs import ClusterCerts, make_cluster_certs  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB]
TARGET_SIZE = 16 * MiB
TARGETS = {"tcp_vs_raw": 0.8, "shm_vs_memcpy": 0.7, "tcp_vs_grpc": 3.0}
TRANSPORTS = ("tcp", "shm", "tcp+tls")   # series measured on the local clusters
GRPC_MAX = 128 * MiB
GRPC_OPTIONS = [("grpc.max_send_message_length", GRPC_MAX),
                ("grpc.max_receive_message_length", GRPC_MAX)]


# -- raw socket reference -----------------------------------------------------------
# request: op (b"W" or b"R") + 8-byte length; a write is followed by the payload and
# answered by one byte, a read is answered by the payload.
def _raw_server(listener: socket.socket, certs: ClusterCerts | None = None) -> None:
    buf = bytearray(max(SIZES))
    view = memoryview(buf)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if certs is not None:
            conn = certs.daemon().server_context().wrap_socket(conn, server_side=True)
        with conn:
            while True:
                head = _recv_exact(conn, memoryview(bytearray(9)))
                if head is None:
                    break
                op, n = head[:1].tobytes(), struct.unpack("<Q", head[1:])[0]
                if op == b"W":
                    if _recv_exact(conn, view[:n]) is None:
                        break
                    conn.sendall(b"k")
                else:
                    conn.sendall(view[:n])


def _recv_exact(conn: socket.socket, view: memoryview) -> memoryview | None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return view


class RawSocket:
    """The raw socket reference; with ``certs``, the same over TLS (``ssl`` sockets with
    the cluster's certificates: what Python's TLS can move with no protocol around it)."""

    def __init__(self, certs: ClusterCerts | None = None) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self.proc = mp.get_context("fork").Process(target=_raw_server, args=(listener, certs),
                                                   daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(listener.getsockname())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if certs is not None:
            self.sock = certs.client().client_context().wrap_socket(self.sock, server_hostname="localhost")
        listener.close()
        self.ack = memoryview(bytearray(1))

    def write(self, data: memoryview) -> None:
        self.sock.sendall(b"W" + struct.pack("<Q", len(data)))
        self.sock.sendall(data)
        _recv_exact(self.sock, self.ack)

    def read(self, out: memoryview) -> None:
        self.sock.sendall(b"R" + struct.pack("<Q", len(out)))
        _recv_exact(self.sock, out)

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.join()


# -- gRPC reference -----------------------------------------------------------------
def _grpc_server(port_queue: mp.Queue) -> None:
    from concurrent import futures
    blob = bytes(max(SIZES))

    def put(request: bytes, context: object) -> bytes:
        return b"k"

    def get(request: bytes, context: object) -> bytes:
        return blob[:struct.unpack("<Q", request)[0]]

    handlers = {"Put": grpc.unary_unary_rpc_method_handler(put),
                "Get": grpc.unary_unary_rpc_method_handler(get)}
    server = grpc.server(futures.ThreadPoolExecutor(4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Blob", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_queue.put(port)
    server.wait_for_termination()


class GrpcBlob:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_grpc_server, args=(q,), daemon=True)
        self.proc.start()
        port = q.get(timeout=60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
        self.put = self.channel.unary_unary("/bench.Blob/Put")
        self.get = self.channel.unary_unary("/bench.Blob/Get")

    def write(self, data: memoryview) -> None:
        self.put(bytes(data))  # a unary call needs the payload as one bytes object

    def read(self, out: memoryview) -> None:
        reply = self.get(struct.pack("<Q", len(out)))
        out[:] = reply

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.join()


# -- the run ------------------------------------------------------------------------
def measure(sizes: list[int], seconds: float, repeats: int,
            transports: tuple[str, ...] = TRANSPORTS) -> dict:
    src = np.random.default_rng(0).integers(0, 255, max(sizes), dtype=np.uint8)
    dst = np.empty_like(src)
    rows: dict[str, dict[str, dict[str, float]]] = {}

    def record(series: str, op: str, size: int, mbps: float) -> None:
        rows.setdefault(series, {}).setdefault(op, {})[str(size)] = mbps

    raw, rpc = RawSocket(), GrpcBlob()
    certs_dir = tempfile.mkdtemp(prefix="smb-bench-tls-")
    raw_tls = RawSocket(make_cluster_certs(certs_dir)) if "tcp+tls" in transports else None
    points = len(sizes) * (3 + (raw_tls is not None) + 2 * len(transports))
    bar = tqdm(total=points, desc="dataplane", unit="point")
    capacity = f"{2 * max(sizes) // MiB + 64}M"
    try:
        with contextlib.ExitStack() as clusters:
            cluster = clusters.enter_context(LocalCluster(servers=2, capacity=capacity,
                                                          log_level="WARNING"))
            tls_cluster = cluster
            if "tcp+tls" in transports:
                tls_cluster = clusters.enter_context(LocalCluster(
                    servers=2, capacity=capacity, log_level="WARNING", transports="tcp", tls=True))
            for each in {id(cluster): cluster, id(tls_cluster): tls_cluster}.values():
                with each.client() as admin:
                    for n in (1, 2):
                        admin.create_region(f"bench/{n}", max(sizes), placement="striped",
                                            stripe_unit=MiB, num_servers=n).close()
            for size in sizes:
                s, d = memoryview(src[:size]), memoryview(dst[:size])
                bar.set_postfix_str(format_bytes(size))
                record("memcpy", "write", size,
                       timed(lambda size=size: np.copyto(dst[:size], src[:size]), size, seconds, repeats))
                record("memcpy", "read", size, rows["memcpy"]["write"][str(size)])
                bar.update()
                record("raw socket", "write", size, timed(lambda s=s: raw.write(s), size, seconds, repeats))
                record("raw socket", "read", size, timed(lambda d=d: raw.read(d), size, seconds, repeats))
                bar.update()
                record("gRPC", "write", size, timed(lambda s=s: rpc.write(s), size, seconds, repeats))
                record("gRPC", "read", size, timed(lambda d=d: rpc.read(d), size, seconds, repeats))
                bar.update()
                if raw_tls is not None:
                    for op, fn in (("write", raw_tls.write), ("read", raw_tls.read)):
                        buf = s if op == "write" else d
                        record("raw TLS socket", op, size,
                               timed(lambda fn=fn, buf=buf: fn(buf), size, seconds, repeats))
                    bar.update()
                for transport in transports:
                    via = tls_cluster if transport == "tcp+tls" else cluster
                    with via.client(transport=transport.partition("+")[0]) as c:
                        for n in (1, 2):
                            r = c.open_region(f"bench/{n}")
                            series = f"{transport}, {n} server{'s' if n > 1 else ''}"
                            record(series, "write", size,
                                   timed(lambda r=r, size=size: r.write(0, src[:size]), size, seconds, repeats))
                            record(series, "read", size,
                                   timed(lambda r=r, size=size: r.read_into(0, dst[:size]), size, seconds, repeats))
                            assert np.array_equal(dst[:size], src[:size]), "read back differs"
                            r.close()
                            bar.update()
    finally:
        bar.close()
        raw.close()
        rpc.close()
        if raw_tls is not None:
            raw_tls.close()
        shutil.rmtree(certs_dir, ignore_errors=True)
    return rows


def ratios(rows: dict, size: int) -> dict[str, dict[str, float]]:
    """The ratios at ``size`` of the transports measured (best of 1 and 2 servers)."""
    k = str(size)
    out: dict[str, dict[str, float]] = {}

    def best(transport: str, op: str) -> float | None:
        if f"{transport}, 1 server" not in rows:
            return None
        return max(rows[f"{transport}, 1 server"][op][k], rows[f"{transport}, 2 servers"][op][k])

    for op in ("write", "read"):
        tcp, shm, tls = best("tcp", op), best("shm", op), best("tcp+tls", op)
        out[op] = {}
        if tcp is not None:
            out[op].update(tcp_vs_raw=tcp / rows["raw socket"][op][k],
                           tcp_vs_grpc=tcp / rows["gRPC"][op][k])
        if shm is not None:
            out[op]["shm_vs_memcpy"] = shm / rows["memcpy"][op][k]
        if tls is not None and tcp is not None:
            out[op]["tls_vs_tcp"] = tls / tcp
        if tls is not None and "raw TLS socket" in rows:
            out[op]["tls_vs_raw_tls"] = tls / rows["raw TLS socket"][op][k]
    return out


def markdown(rows: dict, sizes: list[int], target: dict) -> str:
    lines = []
    for op in ("write", "read"):
        series = list(rows)
        lines.append(f"**{op}** (MB/s)\n")
        lines.append("| size | " + " | ".join(series) + " |")
        lines.append("| --- |" + " ---: |" * len(series))
        for size in sizes:
            cells = [f"{rows[s][op][str(size)]:,.0f}" for s in series]
            lines.append(f"| {format_bytes(size)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(f"Ratios at {format_bytes(TARGET_SIZE)} (best of 1 and 2 servers; target in brackets):\n")
    names = {"tcp_vs_raw": "tcp / raw socket [≥ 0.8]", "shm_vs_memcpy": "shm / memcpy [≥ 0.7]",
             "tcp_vs_grpc": "tcp / gRPC [≥ 3]", "tls_vs_tcp": "tcp+tls / tcp",
             "tls_vs_raw_tls": "tcp+tls / raw TLS socket"}
    shown = [k for k in names if k in target["write"]]
    lines.append("| op | " + " | ".join(names[k] for k in shown) + " |")
    lines.append("| --- |" + " ---: |" * len(shown))
    for op, r in target.items():
        lines.append(f"| {op} | " + " | ".join(f"{r[k]:.2f}" for k in shown) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: dict, sizes: list[int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("write", "read"), strict=True):
        for series, data in rows.items():
            style = "--" if series in ("memcpy", "raw socket", "raw TLS socket", "gRPC") else "-"
            ax.plot(sizes, [data[op][str(s)] for s in sizes], style, marker="o", ms=3, label=series)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [format_bytes(s) for s in sizes], rotation=45)
        ax.set_title(f"{op} throughput vs operation size")
        ax.set_xlabel("operation size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MB/s")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = arguments(__doc__.split("\n")[0], "dataplane")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"data planes to measure, of {', '.join(TRANSPORTS)} (default all)")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs/img/dataplane.png"))
    args = ap.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    seconds = 0.2 if args.quick else args.seconds
    transports = tuple(t for t in args.transports.split(",") if t)
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        ap.error(f"unknown transports {sorted(unknown)}; known: {', '.join(TRANSPORTS)}")
    rows = measure(sizes, seconds, args.repeats, transports)
    target = ratios(rows, TARGET_SIZE)
    result = {**machine(), "sizes": sizes, "seconds": seconds, "repeats": args.repeats, "MBps": rows,
              "at_16MiB": target, "targets": TARGETS}
    table = markdown(rows, sizes, target)
    save(result, table, args.out)
    plot(rows, sizes, args.png)
    print(table)
    print(f"results: {args.out}, plot: {args.png}")
    met = all(target[op][k] >= v for op in target for k, v in TARGETS.items() if k in target[op])
    print("targets at 16 MiB:", "met" if met else "NOT all met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
