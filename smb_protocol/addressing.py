"""Data-plane and control-plane addresses.

Every data-plane endpoint is a URI: ``tcp://host:port`` (``tcp+tls://host:port`` when
the server's TCP data plane speaks TLS), ``rdma://host:port`` (the
host:port of the memory server's gRPC service that does the queue-pair exchange) or
``shm:///abs/path/to.sock``. This module parses them and does nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

SCHEMES = ("tcp", "shm", "rdma", "tcp+tls")


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.scheme == "shm":
            return f"shm://{self.path}"
        return f"{self.scheme}://{format_hostport(self.host, self.port)}"


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_hostport(text: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into its parts."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise InvalidArgument(f"bad address {text!r}: unclosed '['")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise InvalidArgument(f"bad address {text!r}: expected host:port")
        return host or "127.0.0.1", default_port
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidArgument(f"bad address {text!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"bad address {text!r}: port out of range")
    return host or "127.0.0.1", port


def parse_endpoint(uri: str) -> Endpoint:
    """Parse a data-plane URI; the error names the known schemes."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in SCHEMES:
        raise InvalidArgument(
            f"unknown data-plane address {uri!r}: expected one of "
            + ", ".join(f"{s}://" for s in SCHEMES))
    if scheme == "shm":
        if not rest.startswith("/"):
            raise InvalidArgument(f"bad shm address {uri!r}: expected shm:///absolute/path")
        return Endpoint("shm", path=rest)
    host, port = parse_hostport(rest)
    return Endpoint(scheme, host=host, port=port)
