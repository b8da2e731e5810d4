"""The client's data plane: one transport session per memory-server endpoint, shared by
every region of the client, and the thread pools that run requests.

:class:`DataPlane` is owned by a :class:`~smb_client.client.Client` and closed with it.
Regions borrow sessions from it (:meth:`DataPlane.session`) and never close them; each
request carries the region's own ticket, which the session presents on a connection
before the first request that needs it. So a client with many regions on a server holds
``connections`` sockets to it, not ``connections`` per region.

Exactly once: a data plane is one client to the memory servers, with a random 64-bit
:attr:`DataPlane.client_id`; it hands out sequence numbers (:meth:`DataPlane.next_seq`)
for mutating requests, each number spaced :data:`SEQ_STRIDE` from the next so that a
transport that splits one request into several messages numbers them ``seq + k``.
A retried request reuses its number and the server applies it at most once.
"""
from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from smb_client import transports
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import InvalidArgument, ServerUnavailable
from smb_protocol.placement import ExtentPlace
from smb_protocol.rdma import verbs

from .futures import wait_all
from .transports import Session

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSPORT_POLICIES = ("auto", "tcp", "shm", "rdma")
SEQ_STRIDE = 1 << 20   # sequence numbers per mutating request (one per message a transport sends for it)


def choose_endpoint(place: ExtentPlace, policy: str, here: str) -> str:
    """The data-plane URI to use for a server, by policy (``auto`` prefers shm on the
    same host, then rdma where this client can do verbs, then tcp)."""
    offered = {uri.partition("://")[0]: uri for uri in place.endpoints}
    if "tcp+tls" in offered:   # the tcp policy takes the server's tcp plane, TLS or not
        offered.setdefault("tcp", offered["tcp+tls"])
    if policy != "auto":
        if policy not in offered:
            raise InvalidArgument(
                f"server {place.server_id} does not offer {policy}://; it offers "
                + (", ".join(sorted(offered)) or "nothing"))
        if policy == "shm" and place.host_id != here:
            raise InvalidArgument(f"shm needs the client on the server's host ({place.server_id})")
        return offered[policy]
    if "shm" in offered and place.host_id == here:
        return offered["shm"]
    if "rdma" in offered and "rdma" in transports.TRANSPORTS and verbs.has_device():
        return offered["rdma"]
    if "tcp" in offered:
        return offered["tcp"]
    raise InvalidArgument(f"server {place.server_id} offers no usable transport: {sorted(offered)}")


class DataPlane:
    """Sessions by endpoint URI (opened on first use, thread-safe) and the io and async
    thread pools. ``policy`` is a transport policy (auto, tcp, shm, rdma); ``here`` this
    host's id; ``connections`` the connections per session; ``token`` the client's bearer
    token; ``transport_options`` go to every session factory. Owns the sessions and the
    pools: :meth:`close` closes them."""

    def __init__(self, policy: str, here: str, *, connections: int = 2, token: str = "",
                 io_threads: int = 16, transport_options: dict[str, Any] | None = None) -> None:
        if policy not in TRANSPORT_POLICIES:
            raise InvalidArgument(f"unknown transport {policy!r}: expected one of "
                                  + ", ".join(TRANSPORT_POLICIES))
        if not isinstance(connections, int) or connections < 1:
            raise InvalidArgument(f"connections must be a positive number per server, not {connections!r}")
        self.policy = policy
        self.here = here
        self.connections = connections
        self.token = token
        self.transport_options = dict(transport_options or {})
        self._sessions: dict[str, Session] = {}
        # endpoint chosen per (server, host, offered endpoints): choosing looks at this
        # host's RDMA devices, which must not happen on every request
        self._chosen: dict[tuple[str, str, tuple[str, ...]], str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.client_id = secrets.randbits(64) | 1   # never 0 ("not tracked")
        self._seqs = itertools.count(SEQ_STRIDE, SEQ_STRIDE)
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="smb-io")
        self._async = ThreadPoolExecutor(io_threads, thread_name_prefix="smb-async")

    def next_seq(self) -> int:
        """A fresh sequence number for one mutating request (thread-safe)."""
        return next(self._seqs)

    # -- sessions ------------------------------------------------------------------
    def session(self, place: ExtentPlace) -> Session:
        """The session to the endpoint chosen for ``place``'s server (borrowed: do not close)."""
        key = (place.server_id, place.host_id, place.endpoints)
        uri = self._chosen.get(key)
        if uri is None:
            uri = self._chosen[key] = choose_endpoint(place, self.policy, self.here)
        return self._session_for(uri, place)

    def coordination(self, place: ExtentPlace) -> Session:
        """The tcp session of ``place``'s server, whatever transport its data uses: waits,
        locks and the counters they watch go through the server (``smb_client.coord``)."""
        for uri in place.endpoints:
            if uri.startswith(("tcp://", "tcp+tls://")):
                return self._session_for(uri, place)
        raise InvalidArgument(f"server {place.server_id} offers no tcp endpoint, which waits, locks and "
                              f"barriers need; it offers {', '.join(sorted(place.endpoints))}")

    def sessions(self) -> dict[str, Session]:
        """A snapshot of the open sessions by endpoint URI."""
        with self._lock:
            return dict(self._sessions)

    def _session_for(self, uri: str, place: ExtentPlace) -> Session:
        s = self._sessions.get(uri)
        if s is not None:
            return s
        options: dict[str, Any] = {"connections": self.connections,
                                   "grpc_address": place.grpc_address, "token": self.token,
                                   "client_id": self.client_id}
        if uri.startswith("shm://"):
            tcp = [u for u in place.endpoints if u.startswith(("tcp://", "tcp+tls://"))]
            if tcp:   # arithmetic goes to the same server over the shared tcp session
                options["arithmetic"] = self._session_for(tcp[0], place)
        options.update(self.transport_options)
        endpoint = parse_endpoint(uri)
        try:
            factory = transports.TRANSPORTS[endpoint.scheme]
        except KeyError:
            raise InvalidArgument(f"no {endpoint.scheme} transport in this client; have "
                                  + ", ".join(transports.available())) from None
        with self._lock:
            if self._closed:
                raise ServerUnavailable("the client's data plane is closed")
            s = self._sessions.get(uri)
            if s is None:
                log.debug("server %s via %s", place.server_id, uri)
                s = self._sessions[uri] = factory(endpoint, options)
        return s

    # -- running requests ----------------------------------------------------------
    def run(self, tasks: Sequence[Callable[[], T]]) -> list[T]:
        """Run tasks in parallel on the io pool (the first in the caller's thread);
        results in order. The first error wins, raised after every task ended."""
        self._check_open()
        if len(tasks) == 1:
            return [tasks[0]()]
        try:
            futures = [self._io.submit(t) for t in tasks[1:]]
        except RuntimeError:   # shut down meanwhile
            raise ServerUnavailable("the client's data plane is closed") from None
        try:
            first = tasks[0]()
        except BaseException:
            try:
                wait_all(futures)          # every task ends before the error is raised
            except BaseException:
                pass                       # the first task's error wins
            raise
        return [first, *wait_all(futures)]

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn`` on the async pool (the ``*_async`` forms of Region)."""
        self._check_open()
        try:
            return self._async.submit(fn, *args, **kwargs)
        except RuntimeError:
            raise ServerUnavailable("the client's data plane is closed") from None

    def _check_open(self) -> None:
        if self._closed:
            raise ServerUnavailable("the client's data plane is closed (Client.close was called)")

    def close(self) -> None:
        """Refuse new work, wait for submitted work, then close every session. Idempotent."""
        self._closed = True
        self._async.shutdown(wait=True)
        self._io.shutdown(wait=True)
        with self._lock:
            sessions, self._sessions = self._sessions, {}
        # shm sessions first: they borrow the tcp session of their server
        for uri, s in sorted(sessions.items(), key=lambda kv: not kv[0].startswith("shm://")):
            try:
                s.close()
            except Exception as exc:
                log.debug("closing %s: %s", uri, exc)
