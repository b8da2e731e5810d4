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
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from smb_client import transports
from smb_protocol import tracing
from smb_protocol.addressing import parse_endpoint
from smb_protocol.errors import Closed, InvalidArgument, ServerUnavailable
from smb_protocol.placement import ExtentPlace
from smb_protocol.rdma import verbs

from .futures import wait_all
from .transports import Session

log = logging.getLogger(__name__)

CLOSED = "the client's data plane is closed (Client.close was called); make a new client with smb_client.connect()"

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
        # the latest description of each server (by id): where its sessions connect
        self._served: dict[str, ExtentPlace] = {}
        # endpoint URI chosen per server id, for data and for coordination: choosing
        # looks at this host's RDMA devices, which must not happen on every request
        self._chosen: dict[str, str] = {}
        self._coordinating: dict[str, str] = {}
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
    def learn(self, places: Iterable[ExtentPlace]) -> None:
        """Take the controller's latest word on where these places' servers listen (call
        it with every region description the controller sends). A server that now lists
        other endpoints (it restarted on a new port, moved, failed over) gets new
        sessions: those bound to an endpoint it no longer lists are closed and forgotten,
        and so is the endpoint chosen for it. Requests on a place described earlier go to
        the endpoints learned last (the server id names the server, not its address)."""
        stale: list[tuple[str, Session]] = []
        with self._lock:
            for place in places:
                known = self._served.get(place.server_id)
                if not place.endpoints or (known is not None and _where(known) == _where(place)):
                    continue   # nothing new (a server listed without endpoints says nothing of them)
                self._served[place.server_id] = place
                self._chosen.pop(place.server_id, None)
                self._coordinating.pop(place.server_id, None)
                if known is None:
                    continue
                log.info("server %s now listens on %s (was %s)", place.server_id,
                         ", ".join(place.endpoints), ", ".join(known.endpoints))
                for uri in set(known.endpoints) - set(place.endpoints):
                    s = self._sessions.pop(uri, None)
                    if s is not None:
                        stale.append((uri, s))
        _close_all(stale)

    def session(self, place: ExtentPlace) -> Session:
        """The session to the endpoint chosen for ``place``'s server (borrowed: do not close)."""
        uri = self._chosen.get(place.server_id)
        if uri is not None:
            s = self._sessions.get(uri)
            if s is not None:
                return s
        return self._open(place, coordination=False)

    def coordination(self, place: ExtentPlace) -> Session:
        """The tcp session of ``place``'s server, whatever transport its data uses: waits,
        locks, collectives and the counters they watch go through the server (see
        :mod:`smb_client.coord`)."""
        uri = self._coordinating.get(place.server_id)
        if uri is not None:
            s = self._sessions.get(uri)
            if s is not None:
                return s
        return self._open(place, coordination=True)

    def _coordination_of(self, server_id: str) -> Session:
        """The tcp session of server ``server_id`` at the endpoint learned last (what an
        shm session borrows for arithmetic, looked up on every use: no lock, no call on
        the common path)."""
        uri = self._coordinating.get(server_id)
        if uri is not None:
            s = self._sessions.get(uri)
            if s is not None:
                return s
        place = self._served.get(server_id)
        if place is None:
            raise ServerUnavailable(f"server {server_id}: no endpoint known")
        return self._open(place, coordination=True)

    def sessions(self) -> dict[str, Session]:
        """A snapshot of the open sessions by endpoint URI."""
        with self._lock:
            return dict(self._sessions)

    def _open(self, place: ExtentPlace, coordination: bool) -> Session:
        """Choose the endpoint of ``place``'s server (as learned last) and return its
        session, made when missing."""
        with self._lock:
            if self._closed:
                raise Closed(CLOSED)
            served = self._served.setdefault(place.server_id, place)
            chosen = self._coordinating if coordination else self._chosen
            uri = chosen.get(place.server_id)
            if uri is None:
                uri = _tcp_endpoint(served) if coordination else choose_endpoint(served, self.policy, self.here)
                chosen[place.server_id] = uri
            s = self._sessions.get(uri)
            if s is not None:
                return s
            endpoint = parse_endpoint(uri)
            try:
                factory = transports.TRANSPORTS[endpoint.scheme]
            except KeyError:
                raise InvalidArgument(f"no {endpoint.scheme} transport in this client; have "
                                      + ", ".join(transports.available())) from None
            options: dict[str, Any] = {"connections": self.connections,
                                       "grpc_address": served.grpc_address, "token": self.token,
                                       "client_id": self.client_id}
            if endpoint.scheme == "shm":   # arithmetic: the server's tcp session, looked up when used
                options["arithmetic"] = partial(self._coordination_of, place.server_id)
            options.update(self.transport_options)
            log.debug("server %s via %s", place.server_id, uri)
            s = self._sessions[uri] = factory(endpoint, options)   # makes no connection yet
            return s

    # -- running requests ----------------------------------------------------------
    def run(self, tasks: Sequence[Callable[[], T]]) -> list[T]:
        """Run tasks in parallel on the io pool (the first in the caller's thread);
        results in order. The first error wins, raised after every task ended."""
        self._check_open()
        if len(tasks) == 1:
            return [tasks[0]()]
        if tracing.enabled():   # the requests join the caller's trace
            tasks = [tracing.carried(t) for t in tasks]
        futures: list[Future[T]] = []
        for t in tasks[1:]:
            try:
                futures.append(self._io.submit(t))
            except RuntimeError:
                self._check_open()   # closed meanwhile; else the interpreter is exiting:
                futures.append(_ran_here(t))   # atexit handlers still get their work done
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
        if tracing.enabled():   # the operation joins the caller's trace
            fn = tracing.carried(partial(fn, *args, **kwargs))
            args, kwargs = (), {}
        try:
            return self._async.submit(fn, *args, **kwargs)
        except RuntimeError:
            self._check_open()
            return _ran_here(partial(fn, *args, **kwargs))   # the interpreter is exiting

    def _check_open(self) -> None:
        if self._closed:
            raise Closed(CLOSED)

    def close(self) -> None:
        """Refuse new work, wait for submitted work, then close every session. Idempotent."""
        self._closed = True
        self._async.shutdown(wait=True)
        self._io.shutdown(wait=True)
        with self._lock:
            sessions, self._sessions = self._sessions, {}
        _close_all(list(sessions.items()))


def _where(place: ExtentPlace) -> tuple[str, str, tuple[str, ...]]:
    """What a session to ``place``'s server is bound to: its host, gRPC address, endpoints."""
    return place.host_id, place.grpc_address, place.endpoints


def _tcp_endpoint(place: ExtentPlace) -> str:
    for uri in place.endpoints:
        if uri.startswith(("tcp://", "tcp+tls://")):
            return uri
    raise InvalidArgument(f"server {place.server_id} offers no tcp endpoint, which waits, locks, "
                          f"collectives and barriers need; it offers {', '.join(sorted(place.endpoints))}")


def _close_all(sessions: list[tuple[str, Session]]) -> None:
    """Close sessions, shm first (they borrow their server's tcp session)."""
    for uri, s in sorted(sessions, key=lambda kv: not kv[0].startswith("shm://")):
        try:
            s.close()
        except Exception as exc:   # closing must not stop closing the others
            log.debug("closing %s: %s", uri, exc)


def _ran_here(fn: Callable[[], T]) -> Future[T]:
    """A future of ``fn`` run in the caller's thread: the pools refuse work once the
    interpreter began to exit (``threading`` shuts executors down before ``atexit``
    handlers run), and a handler that ends a job still has requests to send."""
    future: Future[T] = Future()
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)
    return future
