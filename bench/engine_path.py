"""A collective's chunk request through the memory server's request engine alone: no
socket, no thread switch, the payload already in memory (as an rdma plane hands it
over), against the bytes work the same request cannot avoid, in the same run.

    .venv/bin/python bench/engine_path.py                       # 4, 64 and 512 KiB, 4 parties
    .venv/bin/python bench/engine_path.py --chunk-kib 64 --profile
    .venv/bin/python bench/engine_path.py --parties 8 --rounds 200 --out results.jsonl

The server's own arena, exactly-once table, tickets, round rules and kernels
(``smb_server.memserver``: :class:`~smb_server.memserver.engine.Engine` over a
:class:`~smb_server.memserver.node.Node`) serve ``--parties`` parties' ``REDUCE`` of
every chunk of a float32 collective, round after round, as the planes hand them over:
each party's push (:meth:`Engine.handle`), then each party's sum
(:meth:`Engine.deliver`), numbered as clients number them. The peer is a lean one of
this file's (tickets presented once, the payload a prebuilt buffer, an answer's bytes
counted, not copied). Every round's first sum is checked exactly.

The reference is the bytes work of the same requests, timed in the same run: the first
push copied into its slot (memcpy), each later one added (the project's kernel); the
sums leave as views of the slot (copying them is the socket's work, or the rdma
device's), so nothing else. Printed per chunk size, one JSON line: the
engine's microseconds per chunk request (a party's push and its sum, the best of
``--repeat`` timings of ``--rounds`` rounds), the reference's, their difference (the
request's own Python: checks, exactly-once, rounds, locks, bookkeeping) and the
reference's share of the engine's time. With ``--profile``, the engine's time once more
under cProfile, split by where it runs (each function's own time, grouped by module):
the shares, and the unprofiled time per request split by them (cProfile's own cost
per call inflates small functions' shares a little).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.process_cpu import write_lines  # noqa: E402
from smb_protocol import tickets  # noqa: E402
from smb_protocol.chunk_types import ChunkTypes  # noqa: E402
from smb_protocol.dtypes import DType  # noqa: E402
from smb_protocol.requests import Pull, Reduce  # noqa: E402
from smb_protocol.rounds import ChunkRound  # noqa: E402
from smb_protocol.wire import Op  # noqa: E402
from smb_server.memserver import kernels  # noqa: E402
from smb_server.memserver.access import TicketBook  # noqa: E402
from smb_server.memserver.arena import Arena  # noqa: E402
from smb_server.memserver.engine import Engine  # noqa: E402
from smb_server.memserver.node import Node  # noqa: E402
from smb_server.memserver.peer import Whole  # noqa: E402
from smb_server.memserver.stats import PlaneStats  # noqa: E402

SECRET = b"b" * 32
REGION = "bench/engine"
EXTENT = 1
F32 = ChunkTypes(DType.FLOAT32, DType.NONE)
#: where the engine's own time goes, by module (``--profile``); others by their module's name
GROUPS = {
    "collective_ops": "chunk rules (collective_ops: checks, waits, counts)",
    "engine": "engine dispatch",
    "dedup": "exactly-once table",
    "access": "ticket checks",
    "tickets": "ticket checks",
    "rounds": "round arithmetic",
    "requests": "request objects",
    "<string>": "request objects",
    "kernels": "kernels' Python faces",
    "_native": "kernels (C)",
    "extent": "extent pins and views",
    "replication": "replication bookkeeping",
    "stats": "statistics",
    "threading": "locks",
    "waiters": "waiters",
    "chunk_types": "chunk types",
    "enum": "enum lookups",
    "contextlib": "context managers",
    "peer": "payload hand-over",
    "~": "built-in calls (clocks, views, dicts)",
}


class LeanPeer:
    """A connection as the engine sees it (:class:`~smb_server.memserver.peer.Peer`):
    tickets presented once, the payload a prebuilt buffer, answers counted (and, when
    asked, the ends of the next one kept: a sum is checked by its first and last
    element)."""

    name = "bench"
    dedup_wait = 5.0
    takes_replicated = False

    def __init__(self, token: str, payload: memoryview) -> None:
        self.tickets = TicketBook()
        self.tickets.add(tickets.verify(SECRET, token))
        self.stats = PlaneStats("bench")
        self._payload = payload
        self.answered = 0
        self.check = False                            # keep the ends of the next answer
        self.ends: tuple[float, float] = (0.0, 0.0)   # the first and last element it had

    @contextmanager
    def payload(self, length: int) -> Iterator[Whole]:
        yield Whole(self._payload[:length])

    def send(self, req_id: int, view: memoryview) -> None:
        self.answered += len(view)
        if self.check:
            ends = np.frombuffer(view, np.float32)[[0, -1]]
            self.ends, self.check = (float(ends[0]), float(ends[1])), False

    def cancelled(self) -> bool:
        return False


class Collective:
    """``chunks`` float32 chunks of ``chunk`` bytes for ``parties`` parties in one
    extent: each chunk two slots (rounds alternate) with a count word behind each."""

    def __init__(self, parties: int, chunk: int, chunks: int) -> None:
        self.parties, self.chunk, self.chunks = parties, chunk, chunks
        self.stride = chunk + 64
        self.arena = Arena(2 * chunks * self.stride + (1 << 20))
        self.node = Node(self.arena, SECRET)
        self.engine = Engine(self.node)
        self.arena.reserve(EXTENT, REGION, 2 * chunks * self.stride)
        token = tickets.sign(SECRET, REGION, [EXTENT], "rw", ttl=3600.0)[0]
        self.pushes = [np.full(chunk // 4, p + 1, np.float32) for p in range(parties)]
        self.peers = [LeanPeer(token, self.pushes[p].data.cast("B")) for p in range(parties)]
        self.seq = [2] * parties
        self.round = 0
        self.slots = np.ones(2 * chunks * self.stride, np.uint8)   # the reference's, touched once

    def run(self, rounds: int) -> None:
        """``rounds`` more rounds of every chunk through the engine; the first sum of
        each round checked."""
        engine, peers, code, want = self.engine, self.peers, F32.code(), self.parties * (self.parties + 1) / 2
        for _ in range(rounds):
            r = self.round
            for c in range(self.chunks):
                offset = (2 * c + r % 2) * self.stride
                ref = ChunkRound(offset + self.chunk, self.parties, r)
                pulls: list[Pull] = []
                for p, peer in enumerate(peers):
                    req = Reduce(Op.REDUCE, 1, EXTENT, offset, self.chunk, p + 1, self.seq[p], dtype=code,
                                 ref=ref, timeout=5.0)
                    self.seq[p] += 2
                    engine.handle(peer, req)
                    pulls.append(req.pull())
                peers[0].check = c == 0
                for peer, pull in zip(peers, pulls, strict=True):
                    engine.deliver(peer, pull)
                if c == 0 and peers[0].ends != (want, want):
                    raise SystemExit(f"round {r}: a wrong sum {peers[0].ends}, not {want}")
            self.round += 1

    def reference(self, rounds: int) -> None:
        """The bytes work of the same requests in the engine, on slots laid out as the
        extent's (the same memory footprint): the first push copied into its slot, the
        later ones added (the sums go out as views of the slot: copying them is the
        socket's work, or the rdma device's)."""
        memory, n = self.slots, self.chunk
        pushes = [p.data.cast("B") for p in self.pushes]
        for r in range(rounds):
            for c in range(self.chunks):
                offset = (2 * c + r % 2) * self.stride
                slot = memory[offset:offset + n]
                np.copyto(slot, np.frombuffer(pushes[0], np.uint8))
                view = slot.data
                for src in pushes[1:]:
                    kernels.accumulate(view, src, DType.FLOAT32)

    def close(self) -> None:
        self.node.close()
        self.arena.close()


def best(fn: Any, rounds: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(rounds)
        times.append(time.perf_counter() - start)
    return min(times)


def profile(coll: Collective, rounds: int) -> dict[str, float]:
    """The engine's own time under cProfile, by module group: shares of the total."""
    prof = cProfile.Profile()
    prof.enable()
    coll.run(rounds)
    prof.disable()
    by: dict[str, float] = defaultdict(float)
    for (path, _line, func), (_cc, _nc, own, _cum, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        module = os.path.splitext(os.path.basename(path))[0]
        if "_native" in func:   # the C kernels' built-in methods
            module = "_native"
        if module == "engine_path":
            continue   # the driving loop of this file
        by[GROUPS.get(module, module)] += own
    total = sum(by.values())
    return {k: round(v / total, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--chunk-kib", default="4,64,512", help="chunk sizes, KiB, comma-separated")
    ap.add_argument("--mbytes", type=float, default=4.0, help="the collective's size per chunk size, MB")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per timing")
    ap.add_argument("--repeat", type=int, default=5, help="timings per figure (the best counts)")
    ap.add_argument("--profile", action="store_true", help="where the engine's time goes, by module")
    ap.add_argument("--out", help="also append the JSON lines to this file")
    args = ap.parse_args()
    lines = []
    for kib in (int(k) for k in args.chunk_kib.split(",")):
        chunk = kib << 10
        chunks = max(1, int(args.mbytes * 1e6) // chunk)
        coll = Collective(args.parties, chunk, chunks)
        try:
            coll.run(2)   # warm: the slots, the tables, the kernels
            requests = args.rounds * chunks * args.parties
            print(f"engine_path: {kib} KiB chunks, {chunks} chunks x {args.parties} parties, "
                  f"{args.repeat} x {args.rounds} rounds", file=sys.stderr, flush=True)
            engine_s = best(coll.run, args.rounds, args.repeat)
            ref_s = best(coll.reference, args.rounds, args.repeat)
            line: dict[str, Any] = {
                "chunk_bytes": chunk, "parties": args.parties, "chunks": chunks, "rounds": args.rounds,
                "engine_us_per_request": round(engine_s / requests * 1e6, 2),
                "reference_us_per_request": round(ref_s / requests * 1e6, 2),
                "python_us_per_request": round((engine_s - ref_s) / requests * 1e6, 2),
                "reference_share": round(ref_s / engine_s, 3),
            }
            if args.profile:
                shares = profile(coll, args.rounds)
                line["profile_shares"] = shares
                line["profile_us_per_request"] = {k: round(v * engine_s / requests * 1e6, 1)
                                                  for k, v in shares.items()}
        finally:
            coll.close()
        print(json.dumps(line), flush=True)
        lines.append(line)
    write_lines(args.out, lines)


if __name__ == "__main__":
    main()
