"""A small etcd v3 key-value client: ranges, transactions with compares, leases.

Built on etcd3gw (etcd's v3 JSON gateway over HTTP; see docs/architecture.md for why
that library). This module adds what the controller needs on top of it: several
endpoints (the next one is tried when one does not answer), one HTTP session per
thread (a ``requests.Session`` is not meant to be shared between threads), string
keys under a prefix, and failures turned into ``ControllerUnavailable``.

A store URL reads ``etcd://host:port[,host:port...][/prefix]``; the prefix (default
``/smb``) lets several clusters share one etcd.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception, InternalServerError

from smb_protocol import errors

log = logging.getLogger(__name__)

SCHEME = "etcd://"
DEFAULT_PREFIX = "/smb"
DEFAULT_PORT = 2379
REQUEST_TIMEOUT = 5.0   # seconds one HTTP request to one etcd endpoint may take

Op = dict[str, Any]


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


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(raw["key"]).decode(), base64.b64decode(raw.get("value", "")),
                    int(raw.get("create_revision", 0)), int(raw.get("mod_revision", 0)),
                    int(raw.get("lease", 0)))


# -- operations and compares (plain dicts, as the gateway takes them) -----------------------
def put(key: str, value: str | bytes, lease: int = 0) -> Op:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete(key: str) -> Op:
    return {"request_delete_range": {"key": _b64(key)}}


def delete_range(start: str, end: str) -> Op:
    """Delete the keys in [start, end)."""
    return {"request_delete_range": {"key": _b64(start), "range_end": _b64(end)}}


def get(key: str) -> Op:
    return {"request_range": {"key": _b64(key)}}


def get_prefix(prefix: str) -> Op:
    return {"request_range": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}}


def value_is(key: str, value: str) -> Op:
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


def mod_revision_is(key: str, revision: int) -> Op:
    """True while the key is unchanged since a read at ``revision`` (0: the key is absent)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def create_revision_is(key: str, revision: int) -> Op:
    """True while the key is the one created at ``revision`` (0: the key is absent)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def absent(key: str) -> Op:
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


class EtcdKV:
    """Talks to an etcd cluster through any of ``endpoints``; owns its HTTP sessions."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], timeout: float = REQUEST_TIMEOUT) -> None:
        if not endpoints:
            raise errors.InvalidArgument("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._local = threading.local()
        self._preferred = 0  # index of the endpoint that answered last

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _client(self, index: int) -> Etcd3Client:
        clients: dict[int, Etcd3Client] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        client = clients.get(index)
        if client is None:
            host, port = self.endpoints[index]
            client = clients[index] = Etcd3Client(host, port, timeout=self.timeout, api_path="/v3/")
            # etcd is reached directly: no proxy or netrc look-up in the environment on
            # every request (a third of the CPU of a call otherwise)
            client.session.trust_env = False
        return client

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST to the first endpoint that answers; raises ControllerUnavailable when none
        does, ServerError when etcd refuses the request itself (a malformed or too large
        transaction: trying another member would not help)."""
        start = self._preferred
        problems = []
        for k in range(len(self.endpoints)):
            index = (start + k) % len(self.endpoints)
            client = self._client(index)
            try:
                result = client.post(client.get_url(path), json=body)
            except (ConnectionFailedError, ConnectionTimeoutError, InternalServerError) as exc:
                problems.append(f"{self.endpoints[index][0]}:{self.endpoints[index][1]}: "
                                f"{type(exc).__name__} {exc.detail_text or ''}".strip())
                continue
            except Etcd3Exception as exc:
                raise errors.ServerError(f"etcd at {self.endpoints[index][0]}:{self.endpoints[index][1]} "
                                         f"refused {path}: {exc.detail_text or type(exc).__name__}") from None
            self._preferred = index
            return result
        raise errors.ControllerUnavailable(
            f"etcd does not answer at {self.describe()} ({'; '.join(problems)}); "
            "check that etcd runs and has quorum")

    # -- key-value -----------------------------------------------------------------------
    def txn(self, compare: Sequence[Op], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        """One etcd transaction: ``success`` ops when every compare holds, else ``failure``."""
        raw = self._post("/kv/txn", {"compare": list(compare), "success": list(success),
                                     "failure": list(failure)})
        ranges = [[_kv(kv) for kv in r["response_range"].get("kvs", [])]
                  for r in raw.get("responses", []) if "response_range" in r]
        return TxnResult(bool(raw.get("succeeded", False)), int(raw["header"]["revision"]), ranges)

    def read(self, *ops: Op) -> list[list[KeyValue]]:
        """Several range requests read at one revision (a transaction of reads)."""
        return self.txn([], ops).ranges

    def get(self, key: str) -> KeyValue | None:
        (kvs,) = self.read(get(key))
        return kvs[0] if kvs else None

    # -- leases --------------------------------------------------------------------------
    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; returns its id."""
        return int(self._post("/lease/grant", {"TTL": str(int(ttl))})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew a lease; returns its remaining TTL in seconds (<= 0: it has expired)."""
        raw = self._post("/lease/keepalive", {"ID": str(lease)})
        return int(raw.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End a lease now (its keys go); a lease already gone is fine."""
        try:
            self._post("/kv/lease/revoke", {"ID": str(lease)})
        except errors.SMBError as exc:  # gone already, or etcd unreachable: it expires anyway
            log.info("could not revoke etcd lease %x: %s", lease, exc)

    def close(self) -> None:
        """Close this thread's sessions (others close with their threads)."""
        clients: dict[int, Etcd3Client] = getattr(self._local, "clients", {}) or {}
        for client in clients.values():
            client.session.close()
        clients.clear()
