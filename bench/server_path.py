"""A memory server's own CPU cost for a collective's chunk requests (``REDUCE``), with the
clients' cost out of the way: one lightweight sender replays pre-built frames at one server.

    .venv/bin/python bench/server_path.py                          # 25 MB, 4 parties, 64 KiB chunks
    .venv/bin/python bench/server_path.py --chunk-kib 64,512 --rounds 10
    .venv/bin/python bench/server_path.py --chunk-kib 64 --cores 1  # server on core 0, sender on the rest
    .venv/bin/python bench/server_path.py --parties 8 --mbytes 100 --out results.jsonl
    .venv/bin/python bench/server_path.py --wire bf16               # 16-bit pushes, float32 sums

A local cluster (controller + one memory server over tcp) holds a collective
(:meth:`smb_client.Collective.create`) of ``--mbytes`` MB of float32 for ``--parties``
parties at each chunk size of ``--chunk-kib``. No client runs its rounds: what a party
needs (the server's tcp address, the ticket, per chunk its extent, slot and count-word
offsets and length) goes to a sender process, which opens a connection per party,
presents the ticket, and runs ``--rounds`` rounds in lockstep (the first warms up): every
party's ``REDUCE`` of every chunk, numbered as a client numbers them (a client id per
party, ``seq`` spaced by 2), its payload a prebuilt buffer of ``party + 1``; every answer
(``PUSHED``, then the sum) is read and its status checked, and every party's sum of the
first chunk checked exactly (``parties * (parties + 1) / 2``). With ``--wire`` the pushes carry
16-bit values that the server widens into its float32 sums and the sums come back
rounded once (or in float32: ``bf16-full``, ``fp16-full``). To keep the sender cheap,
headers are packed in place once a round and sent with ``sendmsg``; one thread reads all
connections (a selector) into one buffer, in short reads for the answer headers, and
drops the sums it does not check in the kernel (``MSG_TRUNC``: no copy).

Printed per chunk size, one JSON line: the median round (s); the server's CPU (user +
system, all threads, from ``/proc``) over the measured rounds per GB it took in and sent
out (pushes and sums), its user part, per chunk request (ms), and as GB/s per core; the
sender's CPU as a share of the server's (well below 1, or the sender is what is
measured); the share of the pushes that found their chunk's lock held by another
(``smb_server_chunk_pushes_total``: at most these could be summed in one pass with
another); the reference from the same run, one raw TCP socket pair on loopback moving
one round's pushes one way (``raw_socket_MBps``), and the server's in + out bytes per
second relative to it. With two or more sizes, a least-squares fit: server CPU = a * GB
in and out + b * chunk requests. ``--cores N`` pins the server (every thread) to the
first N cores this process may use and the sender to the others (where none are left it
shares them: ``"sender_cores": "shared"``). The server's heartbeats count too (small).
On loopback part of each side's TCP work runs in the other's system time. ``--out``
appends the lines to a file.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import sys
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import smb_client  # noqa: E402
from bench.process_cpu import cpu_split, fit_line, pin, raw_socket_rate, write_lines  # noqa: E402
from smb_protocol import wire  # noqa: E402
from smb_protocol.chunk_types import ChunkTypes, narrow, wire_type  # noqa: E402
from smb_protocol.dtypes import STORAGE, DType, bf16_to_f32  # noqa: E402
from smb_protocol.framing import Answer, ClientFrames  # noqa: E402
from smb_protocol.requests import Reduce  # noqa: E402
from smb_protocol.rounds import ChunkRound  # noqa: E402
from smb_protocol.wire import Op  # noqa: E402
from smb_server.commands.local_cluster import LocalCluster  # noqa: E402
from smb_server.runtime.metrics import parse  # noqa: E402

TIMEOUT = 60.0                    # seconds a push waits for the other parties (the requests' alpha)
HEAD = wire.REQUEST.size          # bytes of a request header
ANSWER = wire.RESPONSE.size       # bytes of an answer header
PEEK = 4 << 10                    # bytes read at once where answer headers come
FIRST_ID = 2                      # request ids on a connection: 1 is the HELLO, then one per chunk and round
#: what the sender needs of one chunk: extent id, (slot 0, slot 1) offsets, (word 0, word 1) offsets, length
ChunkPlan = tuple[int, tuple[int, int], tuple[int, int], int]


class Failed(Exception):
    """A wrong sum, an error answer or a broken connection: the run is void."""


class _Party:
    """One party's connection: its headers (packed in place every round), the round's
    frames still to send, and where its answers stand."""

    def __init__(self, index: int, sock: socket.socket, plan: list[ChunkPlan], parties: int,
                 types: ChunkTypes) -> None:
        self.index, self.sock, self.plan, self.types = index, sock, plan, types
        self.code = types.code()
        self.client = int.from_bytes(os.urandom(8), "little") | 1
        self.heads = bytearray(HEAD * len(plan))
        # per chunk: the bytes its push carries and those its sum comes back in
        self.sent = [types.wire_bytes(c[3]) for c in plan]
        self.answered = [types.answer_bytes(n) for n in self.sent]
        values = np.full(max(c[3] for c in plan) // 4, index + 1, np.float32)
        self.payload = np.empty(len(values), STORAGE[types.sent])
        if types.wire:
            narrow(values, types.wire, self.payload)
        else:
            self.payload[:] = values
        body, heads = self.payload.data.cast("B"), memoryview(self.heads)
        self.frames = [v for i, n in enumerate(self.sent) for v in (heads[i * HEAD:(i + 1) * HEAD], body[:n])]
        # arg0 of each chunk's requests, per slot (the count word's offset and the parties)
        self.arg0 = [tuple(ChunkRound(w, parties, 0).args()[0] for w in c[2]) for c in plan]
        self.views: list[memoryview] = []   # the round's frames still to send
        self.round = self.finals = 0   # the round; its requests answered for good (sum or error)
        self.carry = bytearray()    # an answer header split between two reads
        self.left = 0               # body bytes of the current answer still to come
        self.keep: bytearray | None = None   # the current answer's body, when it is looked at
        self.answer: Answer | None = None
        self.want = float(parties * (parties + 1) // 2)

    def start(self, round_: int) -> None:
        """Pack this round's headers and queue its frames."""
        n, slot = len(self.plan), round_ % 2
        for i, (extent_id, slots, _, _) in enumerate(self.plan):
            k = round_ * n + i
            wire.REQUEST.pack_into(self.heads, i * HEAD, wire.MAGIC, Op.REDUCE, self.code, FIRST_ID + k, extent_id,
                                   slots[slot], self.sent[i], self.arg0[i][slot], round_, TIMEOUT, self.client,
                                   1 + 2 * k)
        self.views, self.round, self.finals = list(self.frames), round_, 0

    def flush(self) -> bool:
        """Send what the socket takes now; True once the round's frames are all out."""
        while self.views:
            try:
                wire.consume(self.views, self.sock.sendmsg(self.views[:wire.IOV_MAX]))
            except BlockingIOError:
                return False
        return True

    def take(self, buf: memoryview, n: int) -> None:
        """Parse ``n`` bytes just read into ``buf``: answer headers and their bodies."""
        pos = 0
        while pos < n:
            if self.left:
                k = min(self.left, n - pos)
                if self.keep is not None:
                    self.keep += buf[pos:pos + k]
                self.left, pos = self.left - k, pos + k
                if not self.left:
                    self._body_done()
                continue
            if self.carry or n - pos < ANSWER:
                k = min(ANSWER - len(self.carry), n - pos)
                self.carry, pos = self.carry + buf[pos:pos + k], pos + k
                if len(self.carry) < ANSWER:
                    return
                header = wire.unpack_answer(self.carry)
                self.carry.clear()
            else:
                header = wire.unpack_answer(buf[pos:pos + ANSWER])
                pos += ANSWER
            self._header(Answer(*header))

    def _header(self, a: Answer) -> None:
        n = len(self.plan)
        k = a.req_id - FIRST_ID - self.round * n
        if not a.unsolicited and not 0 <= k < n:
            raise Failed(f"party {self.index}: an answer to request {a.req_id}, not of round {self.round}")
        self.answer, self.left = a, a.length
        checked = not a.ok or (a.kind == wire.FINAL and k == 0)
        self.keep = bytearray() if checked else None
        if a.kind == wire.FINAL:
            self.finals += 1
            if a.ok and a.length != self.answered[k]:
                raise Failed(f"party {self.index}: a sum of {a.length} bytes for chunk {k}, not {self.answered[k]}")
        if not a.length:
            self._body_done()

    def _body_done(self) -> None:
        a = self.answer
        assert a is not None
        if not a.ok:
            err = ClientFrames(f"party {self.index}").error(a, self.keep or b"")
            raise Failed(f"round {self.round}: request {a.req_id} answered {type(err).__name__}: {err}")
        if self.keep is not None:
            got = np.frombuffer(self.keep, STORAGE[self.types.answer])
            if self.types.answer is DType.BFLOAT16:
                got = bf16_to_f32(got)
            if not (got == self.want).all():
                raise Failed(f"party {self.index}, round {self.round}: chunk 0's sum holds "
                             f"{got[got != self.want][0]}, not {self.want}")
        self.keep = None


def connect(host: str, port: int, ticket: str, index: int) -> socket.socket:
    """A connection that presented ``ticket`` (blocking until the server took it)."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frames = ClientFrames(f"party {index}")
    hello = frames.hello(ticket)
    assert hello is not None and hello[0] == FIRST_ID - 1
    sock.sendall(b"".join(hello[1]))
    a = frames.answer(wire.recv_exact(sock, ANSWER))
    if not a.ok:
        raise Failed(f"party {index}: HELLO refused: {frames.error(a, wire.recv_exact(sock, a.length))}")
    sock.setblocking(False)
    return sock


def run_round(parties: list[_Party], sel: selectors.BaseSelector, buf: memoryview, round_: int) -> None:
    """Send every party's requests of ``round_`` and read every answer."""
    for p in parties:
        p.start(round_)
        if not p.flush():
            sel.modify(p.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, p)
    n, waiting = len(parties[0].plan), len(parties)
    while waiting:
        events = sel.select(TIMEOUT)
        if not events:
            raise Failed(f"round {round_}: no answer for {TIMEOUT:g} s")
        for key, mask in events:
            p = key.data
            if mask & selectors.EVENT_WRITE and p.flush():
                sel.modify(p.sock, selectors.EVENT_READ, p)
            if mask & selectors.EVENT_READ:
                try:
                    if p.left and p.keep is None:   # a sum nobody looks at: dropped by the kernel, not copied
                        got = p.sock.recv_into(buf, min(p.left, len(buf)), socket.MSG_TRUNC)
                    else:   # answer headers in short reads (the bodies they begin are mostly dropped)
                        got = p.sock.recv_into(buf, len(buf) if p.keep is not None else PEEK)
                except BlockingIOError:
                    continue
                if not got:
                    raise Failed(f"party {p.index}: the server closed the connection in round {round_}")
                done = p.finals == n
                p.take(buf, got)
                if not done and p.finals == n:
                    waiting -= 1


def sender(host: str, port: int, ticket: str, plan: list[ChunkPlan], parties: int, rounds: int,
           types: ChunkTypes, cores: list[int] | None, pipe: Connection) -> None:
    """The sender process: ``("warm", s)`` after round 0, waits for ``"go"``, then
    ``("done", results)``; ``("error", message)`` on any failure."""
    try:
        if cores:
            os.sched_setaffinity(0, cores)
        socks = [connect(host, port, ticket, i) for i in range(parties)]
        party = [_Party(i, s, plan, parties, types) for i, s in enumerate(socks)]
        party[0].start(0)   # the header packed in place must be the library's own REDUCE frame
        (extent_id, slots, words, _), client = plan[0], party[0].client
        ref = Reduce(Op.REDUCE, 0, extent_id, slots[0], party[0].sent[0], client, 1, dtype=types.code(),
                     ref=ChunkRound(words[0], parties, 0), timeout=TIMEOUT)
        if ref.to_frame(FIRST_ID) != bytes(party[0].heads[:HEAD]):
            raise Failed("the packed REDUCE header differs from Reduce.to_frame's")
        sel = selectors.DefaultSelector()
        for p in party:
            sel.register(p.sock, selectors.EVENT_READ, p)
        buf = memoryview(bytearray(4 << 20))
        start = time.perf_counter()
        run_round(party, sel, buf, 0)
        pipe.send(("warm", time.perf_counter() - start))
        pipe.recv()
        times = []
        cpu, wall = time.process_time(), time.perf_counter()
        for r in range(1, rounds):
            start = time.perf_counter()
            run_round(party, sel, buf, r)
            times.append(time.perf_counter() - start)
        pipe.send(("done", {"wall_s": time.perf_counter() - wall, "sender_cpu_s": time.process_time() - cpu,
                            "round_s": times}))
    except BaseException as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


def expect(pipe: Connection, proc: mp.process.BaseProcess, what: str) -> Any:
    """The sender's next message, which must be ``what``; SystemExit when it failed."""
    while not pipe.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"the sender died (exit code {proc.exitcode}) without a word")
    kind, value = pipe.recv()
    if kind == "error":
        raise SystemExit(f"server_path: FAILED: {value}")
    assert kind == what, (kind, what)
    return value


def measure(lc: LocalCluster, client: smb_client.Client, args: argparse.Namespace, chunk_bytes: int,
            server_cores: list[int] | None, sender_cores: list[int] | None) -> dict[str, Any]:
    """One chunk size: the server's CPU and the sender's over the measured rounds."""
    name = f"bench/server-path-{chunk_bytes}-{os.getpid()}"
    nbytes = int(args.mbytes * 1e6) // 4 * 4
    coll = smb_client.Collective.create(client, name, nbytes, args.parties, chunk_bytes=chunk_bytes)
    try:
        plan: list[ChunkPlan] = [(c.place.extent_id, c.slots, c.words, c.length) for c in coll.chunks]
        (endpoint,) = {u for c in coll.chunks for u in c.place.endpoints if u.startswith("tcp://")}
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        pid = lc.server_pid(0)
        if server_cores:
            pin(pid, server_cores)
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        wire_name = (args.wire or "").removesuffix("-full")
        types = ChunkTypes(DType.FLOAT32, wire_type(wire_name or None), wire_name != (args.wire or ""))
        proc = ctx.Process(target=sender, args=(host, int(port), coll.region.route.ticket, plan, args.parties,
                                                args.rounds, types, sender_cores, theirs))
        proc.start()
        try:
            expect(ours, proc, "warm")
            if server_cores:
                pin(pid, server_cores)   # threads the connections started, should any have escaped
            pushes0 = chunk_pushes(lc)
            user0, sys0 = cpu_split(pid)
            ours.send("go")
            got = expect(ours, proc, "done")
            user1, sys1 = cpu_split(pid)
            pushes1 = chunk_pushes(lc)
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    finally:
        coll.close()
        client.delete_region(name)
    measured = args.rounds - 1
    cpu, user = (user1 + sys1) - (user0 + sys0), user1 - user0
    sent = sum(types.wire_bytes(c[3]) for c in plan)
    served = (sent + types.answer_bytes(sent)) * args.parties * measured   # bytes in (pushes) and out (sums)
    requests = len(plan) * args.parties * measured
    pushes = {k: pushes1[k] - pushes0[k] for k in pushes1}
    return {"served_GB": served / 1e9, "chunk_requests": requests, "server_cpu_s": cpu, "server_user_s": user,
            "nbytes": coll.nbytes, "chunks": len(plan),
            "pushes_waited_share": pushes["waited"] / max(1, sum(pushes.values())), **got}


def chunk_pushes(lc: LocalCluster) -> dict[str, float]:
    """The server's chunk pushes so far, by whether they found the chunk's lock free or
    waited for it (``smb_server_chunk_pushes_total``)."""
    url = f"http://127.0.0.1:{lc.server_metrics_port(0)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        samples = parse(reply.read().decode())
    return {s.labels["lock"]: s.value for s in samples if s.name == "smb_server_chunk_pushes_total"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--mbytes", type=float, default=25.0)
    ap.add_argument("--rounds", type=int, default=20, help="rounds per chunk size, the first one not measured")
    ap.add_argument("--chunk-kib", default="64", help="chunk sizes (KiB, comma-separated) to measure")
    ap.add_argument("--cores", type=int, default=None,
                    help="pin the memory server to the first N cores, the sender to the others")
    ap.add_argument("--wire", choices=["bf16", "fp16", "bf16-full", "fp16-full"],
                    help="pushes in a 16-bit wire type (sums in float32 on the server, answered rounded "
                         "once, or in float32 with -full)")
    ap.add_argument("--out", help="also append the results as JSON lines to this file")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first one warms up)")
    chunks = [int(k) << 10 for k in args.chunk_kib.split(",") if k]
    allowed = sorted(os.sched_getaffinity(0))
    server_cores = sender_cores = None
    shared = args.cores is not None and args.cores >= len(allowed)
    if args.cores is not None:
        if not 1 <= args.cores <= len(allowed):
            ap.error(f"--cores must lie in 1..{len(allowed)} (the cores this process may use)")
        server_cores, sender_cores = allowed[:args.cores], (allowed[args.cores:] or allowed)
    if shared:
        print(f"server_path: no core left for the sender: it shares cores {server_cores} with the server",
              file=sys.stderr)
    nbytes = int(args.mbytes * 1e6) // 4 * 4
    runs, lines = [], []
    cluster = LocalCluster(1, capacity=max(1 << 30, 4 * nbytes), transports="tcp", metrics=True)
    with cluster as lc, lc.client() as client:
        for chunk in chunks:
            started = time.perf_counter()
            runs.append((chunk, measure(lc, client, args, chunk, server_cores, sender_cores)))
            print(f"server_path: {chunk >> 10} KiB chunks, {args.parties} parties, {args.mbytes:g} MB, "
                  f"{args.rounds} rounds: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    raw = raw_socket_rate(args.parties * nbytes)   # one round's pushes, one way
    for chunk, r in runs:
        cpu, gb = r["server_cpu_s"], r["served_GB"]
        rate = gb * 1e3 / r["wall_s"]               # MB/s in and out
        lines.append({
            "chunk_bytes": chunk, "chunks": r["chunks"], "parties": args.parties, "mbytes": args.mbytes,
            "wire": args.wire or "float32",
            "rounds": args.rounds - 1, "round_s": round(statistics.median(r["round_s"]), 4),
            "server_cpu_s_per_GB": round(cpu / gb, 3), "server_user_s_per_GB": round(r["server_user_s"] / gb, 3),
            "ms_per_chunk_request": round(cpu / r["chunk_requests"] * 1e3, 4),
            "server_GBps_per_core": round(gb / cpu, 2) if cpu > 0 else None,
            "sender_cpu_share": round(r["sender_cpu_s"] / cpu, 3) if cpu > 0 else None,
            "cores": args.cores, "sender_cores": "shared" if shared else sender_cores,
            "pushes_waited_share": round(r["pushes_waited_share"], 3),
            "server_MBps": round(rate, 1), "raw_socket_MBps": round(raw, 1), "ratio_to_raw": round(rate / raw, 3)})
        print(json.dumps(lines[-1]))
    if len(runs) > 1:
        lines.append(fit_line(r for _, r in runs))
        print(json.dumps(lines[-1]))
    write_lines(args.out, lines, append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
