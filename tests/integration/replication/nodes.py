"""In-process memory servers (arena, tcp and shm planes, gRPC service on real sockets)
and a plain numbered-request client, for the server-level replication tests."""
from __future__ import annotations

import itertools
import os

import numpy as np

from smb_client.transports.tcp import TcpSession
from smb_protocol import dtypes, rpc, tickets
from smb_protocol._proto.smb.v1 import memory_server_pb2 as pb
from smb_protocol._proto.smb.v1 import memory_server_pb2_grpc as pb_grpc
from smb_protocol.addressing import parse_endpoint
from smb_server.memserver.arena import Arena
from smb_server.memserver.node import Node as MemoryNode
from smb_server.memserver.service import MemoryServerServicer
from smb_server.memserver.shm_plane import ShmPlane
from smb_server.memserver.stats import PlaneStats
from smb_server.memserver.tcp_plane import TcpPlane
from smb_server.runtime.grpc_util import make_server

SECRET = b"r" * 32
UID = "replicated-region"
MiB = 1 << 20
SIZE = 10 * MiB   # bytes per extent: several 4 MiB forwarding pieces


class Node:
    """One memory server: arena, tcp plane (+ shm), gRPC service; holds extent ``eid``."""

    def __init__(self, name: str, eid: int, tmp_path, size: int = SIZE) -> None:
        self.name, self.eid = name, eid
        self.arena = Arena(4 * size)
        self.node = MemoryNode(self.arena, SECRET)
        self.tcp = TcpPlane(self.node, "127.0.0.1", 0, PlaneStats("tcp"))
        self.shm = ShmPlane(self.node, str(tmp_path / f"{name}.sock"), PlaneStats("shm"))
        self.grpc = make_server(max_workers=8)
        self.servicer = MemoryServerServicer(self.node)
        pb_grpc.add_MemoryServerServicer_to_server(self.servicer, self.grpc)
        port = self.grpc.add_insecure_port("127.0.0.1:0")
        self.grpc.start()
        self.channel = rpc.channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.MemoryServerStub(self.channel)
        self.repl = self.node.replication
        self.repl.timeout = 10.0
        self.arena.reserve(eid, UID, size)
        self.endpoint = f"tcp://127.0.0.1:{self.tcp.port}"

    def configure(self, view: int, role: str, backups=(), sync=()) -> pb.ConfigureReplicasResponse:
        admin = tickets.sign(SECRET, UID, [self.eid], "admin", ttl=600)[0]
        targets = [pb.ReplicaTarget(extent_id=b.eid, server_id=b.name, endpoints=[b.endpoint],
                                    sync=b in sync) for b in backups]
        return rpc.call(self.stub.ConfigureReplicas, pb.ConfigureReplicasRequest(
            ticket=admin, extent_id=self.eid, view=view, role=role, backups=targets), None, 60)

    def data(self) -> bytes:
        return bytes(self.arena.get(self.eid).data)

    def array(self, dtype) -> np.ndarray:
        return np.frombuffer(self.data(), dtype=dtype)

    def close(self) -> None:
        self.repl.close()
        self.tcp.close()
        self.shm.close()
        self.grpc.stop(0)
        self.channel.close()
        self.arena.close()


class Client:
    """A plain client: one id, numbered requests over the tcp session of smb_client."""

    def __init__(self, node: Node, client_id: int | None = None) -> None:
        self.id = client_id or int.from_bytes(os.urandom(8), "little") | 1
        self.seqs = itertools.count(1)
        self.session = self.open(node)

    def open(self, node: Node) -> TcpSession:
        self.node = node
        self.ticket = tickets.sign(SECRET, UID, [node.eid], "rw", ttl=600)[0]
        return TcpSession(parse_endpoint(node.endpoint), {"client_id": self.id, "connections": 2})

    def accumulate(self, offset: int, arr: np.ndarray, seq: int | None = None) -> int:
        seq = seq or next(self.seqs)
        self.session.accumulate(self.ticket, self.node.eid, offset, [memoryview(arr).cast("B")],
                                dtypes.resolve(arr.dtype), seq=seq)
        return seq

    def write(self, offset: int, data: bytes, seq: int | None = None) -> int:
        seq = seq or next(self.seqs)
        self.session.write(self.ticket, self.node.eid, offset, [memoryview(data)], seq=seq)
        return seq

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.session.read_into(self.ticket, self.node.eid, offset, [memoryview(buf)])
        return bytes(buf)

    def close(self) -> None:
        self.session.close()
