"""Settings of the controller and the memory server.

Values come from defaults, then a TOML file, then ``SMB_*`` environment variables,
then command-line flags (later wins). The dataclasses here are plain data; the CLI
fills them.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field


@dataclass
class ControllerConfig:
    listen: str = "127.0.0.1:7700"       # host:port of the gRPC service (port 0: any)
    db_path: str = "smb-controller.db"   # SQLite file (WAL)
    token: str = ""                      # bearer token; empty: no auth
    secret: bytes = b""                  # HMAC key shared with memory servers
    lease_seconds: float = 5.0           # a server silent this long is marked down
    orphan_grace_seconds: float = 30.0   # unknown extents older than this are freed
    ticket_ttl_seconds: float = 3600.0
    ready_file: str = ""                 # written with the bound address once serving


@dataclass
class ServerConfig:
    controller: str = "127.0.0.1:7700"   # host:port of the controller
    listen_host: str = "127.0.0.1"       # address of the gRPC service and the TCP data plane
    advertise_host: str = ""             # address clients use; default listen_host
    grpc_port: int = 0                   # 0: any free port
    tcp_port: int = 0                    # 0: any free port
    capacity: int = 1 << 30              # bytes of RAM this server may hand out
    token: str = ""                      # bearer token of the cluster
    secret: bytes = b""                  # HMAC key shared with the controller
    server_id: str = ""                  # stable id; default: generated and kept in state_dir
    state_dir: str = ""                  # where the server keeps its id and shm socket
    data_dir: str = ""                   # file-backed (persistent) extents live here
    transports: list[str] = field(default_factory=lambda: ["tcp", "shm"])
    heartbeat_seconds: float = 1.0
    tcp_connections_max: int = 1024
    ready_file: str = ""                 # written with the server id once registered


def load_secret(path: str = "", env: str = "SMB_SECRET") -> bytes:
    """The cluster HMAC secret from a file (hex or raw) or the environment (hex)."""
    if path:
        with open(path, "rb") as f:
            data = f.read().strip()
        try:
            return bytes.fromhex(data.decode())
        except ValueError:
            return data
    value = os.environ.get(env, "")
    return bytes.fromhex(value) if value else b""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def new_token() -> str:
    return secrets.token_urlsafe(24)
