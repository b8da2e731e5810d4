"""A small etcd v3 client on etcd's own gRPC API: ranges, transactions with compares,
leases and watches.

The messages are generated at build time from the .proto files of the distribution's
etcd (``make proto``: tools/etcd_protos.py); this module binds the methods it calls
(KV Range and Txn, Lease Grant, Revoke and KeepAlive, Watch) on one gRPC channel to
every endpoint of the cluster. The channel balances over the endpoints that answer
(``round_robin``); a call waits for one to answer (up to ``timeout`` seconds) and one
refused as unavailable is tried again, so a member that dies or has no quorum is passed
over. Keys are strings under a prefix; failures become ``ControllerUnavailable`` (no
member answers) or ``ServerError`` (etcd refuses the request itself).

A store URL reads ``etcd://host:port[,host:port...][/prefix]``; the prefix (default
``/smb``) lets several clusters share one etcd.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc

from smb_protocol import errors
from smb_protocol._proto.etcd.etcdserver.etcdserverpb import rpc_pb2 as pb
from smb_protocol._proto.etcd.mvcc.mvccpb import kv_pb2

log = logging.getLogger(__name__)

SCHEME = "etcd://"
DEFAULT_PREFIX = "/smb"
DEFAULT_PORT = 2379
REQUEST_TIMEOUT = 5.0   # seconds one call may wait for an etcd member to answer
WATCH_RETRY = 0.2       # seconds before a broken watch stream is opened again
# reconnect soon after a member comes back (gRPC's default backoff grows to 120 s)
CHANNEL_OPTIONS = [("grpc.lb_policy_name", "round_robin"),
                   ("grpc.enable_http_proxy", 0),            # etcd is reached directly
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.keepalive_time_ms", 10_000),        # find a member that went silent
                   ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.max_receive_message_length", 64 << 20)]

Op = pb.RequestOp
Cmp = pb.Compare
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def is_etcd_url(url: str) -> bool:
    return url.startswith(SCHEME)


def parse_url(url: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/prefix`` -> ([(h1, 2379), (h2, 2379)], "/prefix").

    Raises InvalidArgument naming what is wrong.
    """
    if not is_etcd_url(url):
        raise errors.InvalidArgument(f"not an etcd store URL: {url!r} (expected {SCHEME}host:port,...)")
    rest = url[len(SCHEME):]
    hosts, slash, path = rest.partition("/")
    prefix = "/" + path.strip("/") if slash and path.strip("/") else DEFAULT_PREFIX
    endpoints = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            continue
        split = urlsplit("//" + part)
        try:
            port = split.port or DEFAULT_PORT
        except ValueError:
            raise errors.InvalidArgument(f"etcd endpoint {part!r} in {url!r}: bad port") from None
        if not split.hostname:
            raise errors.InvalidArgument(f"etcd endpoint {part!r} in {url!r}: no host")
        endpoints.append((split.hostname, port))
    if not endpoints:
        raise errors.InvalidArgument(f"{url!r} names no etcd endpoint (etcd://host:port,...)")
    return endpoints, prefix


def channel_target(endpoints: Sequence[tuple[str, int]]) -> str:
    """The gRPC target of one channel to every endpoint: ``ipv4:a:p,b:p`` (or ``ipv6:``)
    with the endpoints' addresses, or ``host:port`` (DNS) for a single endpoint."""
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    for family, scheme, fmt in ((socket.AF_INET, "ipv4", "{}:{}"), (socket.AF_INET6, "ipv6", "[{}]:{}")):
        try:
            addresses = [fmt.format(info[4][0], port) for host, port in endpoints
                         for info in socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)]
        except socket.gaierror:
            continue
        return f"{scheme}:" + ",".join(dict.fromkeys(addresses))
    raise errors.InvalidArgument("etcd endpoints " + ",".join(f"{h}:{p}" for h, p in endpoints)
                                 + " do not all resolve to addresses of one family (IPv4 or IPv6)")


def _bytes(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(raw: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(raw.key.decode(), raw.value, raw.create_revision, raw.mod_revision, raw.lease)


# -- operations and compares ------------------------------------------------------------------
def put(key: str, value: str | bytes, lease: int = 0) -> Op:
    return pb.RequestOp(request_put=pb.PutRequest(key=_bytes(key), value=_bytes(value), lease=lease))


def delete(key: str) -> Op:
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=_bytes(key)))


def delete_range(start: str, end: str) -> Op:
    """Delete the keys in [start, end)."""
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=_bytes(start), range_end=_bytes(end)))


def get(key: str) -> Op:
    return pb.RequestOp(request_range=pb.RangeRequest(key=_bytes(key)))


def get_prefix(prefix: str) -> Op:
    return pb.RequestOp(request_range=pb.RangeRequest(key=_bytes(prefix), range_end=_prefix_end(prefix)))


def value_is(key: str, value: str) -> Cmp:
    return pb.Compare(key=_bytes(key), result=pb.Compare.EQUAL, target=pb.Compare.VALUE, value=_bytes(value))


def mod_revision_is(key: str, revision: int) -> Cmp:
    """True while the key is unchanged since a read at ``revision`` (0: the key is absent)."""
    return pb.Compare(key=_bytes(key), result=pb.Compare.EQUAL, target=pb.Compare.MOD, mod_revision=revision)


def create_revision_is(key: str, revision: int) -> Cmp:
    """True while the key is the one created at ``revision`` (0: the key is absent)."""
    return pb.Compare(key=_bytes(key), result=pb.Compare.EQUAL, target=pb.Compare.CREATE,
                      create_revision=revision)


def absent(key: str) -> Cmp:
    return create_revision_is(key, 0)


def _prefix_end(prefix: str) -> bytes:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return bytes(raw)


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]]  # the kvs of each range request, in order


@dataclass(frozen=True)
class WatchEvent:
    """One change of a watched key: its new value (``deleted``: its deletion, whose
    ``mod_revision`` is the revision of the delete)."""

    deleted: bool
    kv: KeyValue


class EtcdKV:
    """Talks to an etcd cluster through one gRPC channel to all ``endpoints``; owns it."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float = REQUEST_TIMEOUT) -> None:
        if not endpoints:
            raise errors.InvalidArgument("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.channel = grpc.insecure_channel(channel_target(self.endpoints), options=CHANNEL_OPTIONS)
        ch = self.channel
        self._txn = _method(ch.unary_unary, "KV/Txn", pb.TxnRequest, pb.TxnResponse)
        self._grant = _method(ch.unary_unary, "Lease/LeaseGrant", pb.LeaseGrantRequest, pb.LeaseGrantResponse)
        self._revoke = _method(ch.unary_unary, "Lease/LeaseRevoke", pb.LeaseRevokeRequest, pb.LeaseRevokeResponse)
        self._keepalive = _method(ch.stream_stream, "Lease/LeaseKeepAlive", pb.LeaseKeepAliveRequest,
                                  pb.LeaseKeepAliveResponse)
        self.watch_method = _method(ch.stream_stream, "Watch/Watch", pb.WatchRequest, pb.WatchResponse)

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _call(self, what: str, call: Callable[[float], Resp]) -> Resp:
        """Run ``call(seconds left)`` until a member answers; raises ControllerUnavailable
        when none does within ``timeout``, ServerError when etcd refuses the request
        itself (a malformed or too large transaction: another member would refuse too)."""
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return call(max(left, 0.001))
            except grpc.RpcError as exc:
                code, detail = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.UNAVAILABLE and deadline - time.monotonic() > 0:
                    log.debug("etcd %s: %s; trying again", what, detail)
                    continue    # another member (round robin), or the same once it is back
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED):
                    raise errors.ControllerUnavailable(
                        f"etcd does not answer at {self.describe()} within {self.timeout:g} s "
                        f"({code.name}: {detail}); check that etcd runs and has quorum") from None
                raise errors.ServerError(f"etcd at {self.describe()} refused {what}: {detail}") from None

    # -- key-value -----------------------------------------------------------------------
    def txn(self, compare: Sequence[Cmp], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One etcd transaction: ``success`` ops when every compare holds, else ``failure``."""
        request = pb.TxnRequest(compare=compare, success=success, failure=failure)
        raw = self._call("Txn", lambda t: self._txn(request, timeout=t, wait_for_ready=True))
        ranges = [[_kv(kv) for kv in r.response_range.kvs]
                  for r in raw.responses if r.WhichOneof("response") == "response_range"]
        return TxnResult(raw.succeeded, raw.header.revision, ranges)

    def read(self, *ops: Op) -> list[list[KeyValue]]:
        """Several range requests read at one revision (a transaction of reads)."""
        return self.txn([], ops).ranges

    def get(self, key: str) -> KeyValue | None:
        (kvs,) = self.read(get(key))
        return kvs[0] if kvs else None

    # -- leases --------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        request = pb.LeaseGrantRequest(TTL=int(ttl))
        raw = self._call("LeaseGrant", lambda t: self._grant(request, timeout=t, wait_for_ready=True))
        if raw.error:
            raise errors.ServerError(f"etcd at {self.describe()} refused a lease: {raw.error}")
        return int(raw.ID)

    def keepalive(self, lease: int) -> int:
        """Renew a lease; returns its remaining TTL in seconds (<= 0: it has expired)."""
        def once(t: float) -> pb.LeaseKeepAliveResponse:
            call = self._keepalive(iter([pb.LeaseKeepAliveRequest(ID=lease)]), timeout=t, wait_for_ready=True)
            try:
                for response in call:
                    got: pb.LeaseKeepAliveResponse = response
                    return got
                return pb.LeaseKeepAliveResponse(TTL=0)   # the stream ended: no such lease
            finally:
                call.cancel()
        return int(self._call("LeaseKeepAlive", once).TTL)

    def revoke(self, lease: int) -> None:
        """End a lease now (its keys go); a lease already gone is fine."""
        request = pb.LeaseRevokeRequest(ID=lease)
        try:
            self._call("LeaseRevoke", lambda t: self._revoke(request, timeout=t, wait_for_ready=True))
        except errors.SMBError as exc:  # gone already, or etcd unreachable: it expires anyway
            log.info("could not revoke etcd lease %x: %s", lease, exc)

    # -- watches -------------------------------------------------------------------------
    def watch(self, key: str, start_revision: int, on_events: Callable[[list[WatchEvent]], None],
              prefix: bool = False) -> Watch:
        """Watch ``key`` (or every key under it, with ``prefix``) from ``start_revision``
        on (0: from now); see :class:`Watch`. The caller cancels it."""
        watch = Watch(self, key, start_revision, on_events, prefix)
        watch.start()
        return watch

    def close(self) -> None:
        """Close the channel (watches end); idempotent."""
        self.channel.close()


class Watch:
    """One etcd watch, served by a thread of its own: ``on_events(events)`` runs on that
    thread for every batch of changes, in revision order.

    A stream that breaks (etcd restarts, a member goes) is opened again from the
    revision after the last one seen, so no change is missed. If etcd compacted those
    revisions away, the watch starts again from now and ``on_events([])`` tells the
    caller to read what it watches afresh.
    """

    def __init__(self, kv: EtcdKV, key: str, start_revision: int,
                 on_events: Callable[[list[WatchEvent]], None], prefix: bool = False) -> None:
        self._kv = kv
        self._key = _bytes(key)
        self._end = _prefix_end(key) if prefix else b""
        self._next = start_revision
        self._on_events = on_events
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _requests(self, done: threading.Event) -> Iterator[pb.WatchRequest]:
        yield pb.WatchRequest(create_request=pb.WatchCreateRequest(
            key=self._key, range_end=self._end, start_revision=self._next))
        done.wait()   # the stream stays open until it is over

    def _run(self) -> None:
        while not self._stop.is_set():
            done = threading.Event()
            try:
                call = self._kv.watch_method(self._requests(done), wait_for_ready=True)
                with self._lock:
                    self._call = call
                if self._stop.is_set():
                    call.cancel()
                for response in call:
                    if response.compact_revision:
                        log.warning("etcd watch on %s: revisions up to %d compacted; reading afresh",
                                    self._key.decode(), response.compact_revision)
                        self._next = 0
                        self._on_events([])
                        break
                    if response.created and not self._next:
                        self._next = response.header.revision + 1
                    if response.events:
                        self._next = response.events[-1].kv.mod_revision + 1
                        self._on_events([WatchEvent(e.type == kv_pb2.Event.DELETE, _kv(e.kv))
                                         for e in response.events])
                    if response.canceled:
                        break
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    log.info("etcd watch on %s broke (%s); opening it again", self._key.decode(),
                             exc.code())
            except Exception:
                log.exception("etcd watch on %s", self._key.decode())
            finally:
                done.set()
            self._stop.wait(WATCH_RETRY)

    def cancel(self) -> None:
        """End the watch and its thread (idempotent); no callback runs after it returns,
        unless it is called from one."""
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()


def _method(kind: Callable[..., Any], name: str, request: Any, response: Any) -> Any:
    """etcd's gRPC method ``etcdserverpb.<name>`` on a channel (``kind``: the channel's
    ``unary_unary`` or ``stream_stream``), its messages ``request`` and ``response``."""
    return kind(f"/etcdserverpb.{name}", request_serializer=request.SerializeToString,
                response_deserializer=response.FromString)
