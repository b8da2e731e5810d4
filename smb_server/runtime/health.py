"""The standard gRPC health service (``grpc.health.v1.Health``) on a daemon's gRPC port.

Load balancers, ``grpc_health_probe`` and ``smb status`` ask ``Check`` (or ``Watch``)
for the empty service name (the whole daemon) or for the daemon's own service
(``smb.v1.Controller`` or ``smb.v1.MemoryServer``). Both answer ``SERVING`` while the
daemon runs and ``NOT_SERVING`` from the moment it starts to shut down. Health calls
need no bearer token (see :data:`HEALTH_METHODS`).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from smb_protocol import rpc

log = logging.getLogger(__name__)

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
CHECK_TIMEOUT = 2.0  # seconds


class Health:
    """The health servicer of one gRPC server, for the names in ``services`` plus ``""``.

    Everything starts ``NOT_SERVING``; the owner calls :meth:`serving` once ready and
    :meth:`shutting_down` when it begins to stop.
    """

    def __init__(self, server: grpc.Server, services: Iterable[str]) -> None:
        self._servicer = health.HealthServicer()
        self.services = ("", *services)
        for name in self.services:
            self._servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def serving(self) -> None:
        for name in self.services:
            self._servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def shutting_down(self) -> None:
        """Report ``NOT_SERVING`` for good (later :meth:`serving` calls are ignored)."""
        self._servicer.enter_graceful_shutdown()


def check(address: str, service: str = "", timeout: float = CHECK_TIMEOUT) -> str:
    """Ask the health service at ``host:port``: ``SERVING``, ``NOT_SERVING``,
    ``SERVICE_UNKNOWN``, or ``UNREACHABLE`` when there is no answer within ``timeout``
    seconds."""
    channel = rpc.channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        log.debug("health check of %s: %s", address, exc)
        return "UNREACHABLE"
    finally:
        channel.close()
