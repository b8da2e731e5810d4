"""Server-side gRPC helpers: bearer-token auth, roles, admission and typed errors."""
from __future__ import annotations

import contextvars
import functools
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, TypeVar

import grpc

from smb_protocol import errors, waits
from smb_protocol.rpc import ERROR_KEY, MESSAGE_SIZE_OPTIONS, status_code_for
from smb_protocol.tls import TLSConfig

from .credentials import ADMIN, CLIENT, INSECURE, SERVER, Credentials, Principal

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL = 10.0  # seconds; per interval, refusals beyond REFUSALS_LOGGED ...
REFUSALS_LOGGED = 10         # ... are logged as one count at the start of the next
# where the credential of each role comes from, said when a call needs the role
ROLE_CREDENTIALS = {
    ADMIN: "an operator's credential is SMB_ADMIN_TOKEN (or the file SMB_ADMIN_TOKEN_FILE names), which "
           "`smb server drain` and the like read, or the one derived from the shared secret",
    CLIENT: "a client's credential is the cluster's token (SMB_TOKEN, or token=...)",
    SERVER: "a memory server's credential is derived from the shared secret (secret_file, SMB_SECRET)",
}
_PRINCIPAL: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("smb_principal",
                                                                             default=None)

# what a server interceptor is handed and returns (the generic forms exist in the stubs only)
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None]"

if TYPE_CHECKING:  # generic in the type stubs only; grpc's own class takes no parameters
    ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    ServerInterceptor = grpc.ServerInterceptor

_Servicer = TypeVar("_Servicer")
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")


class BearerAuth(ServerInterceptor):
    """Refuse calls without ``authorization: Bearer <token>``, from the metadata alone (a
    refused call's body is never deserialized).

    ``exempt`` holds full method names (``/smb.v1.MemoryServer/ReserveExtent``) whose
    handlers check a ticket instead: they may come without a credential, but one that is
    presented must be right. With ``token`` empty, every call is allowed.
    """

    def __init__(self, token: str, exempt: Iterable[str] = ()) -> None:
        self._expected = f"Bearer {token}".encode() if token else b""
        self._exempt = frozenset(exempt)
        refused = _RefusalLog()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            refused("a call", context.peer(), "missing or wrong bearer token")
            abort(context, errors.AuthenticationError(
                "missing or wrong bearer token (set SMB_TOKEN or pass token=...)"))

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        if not self._expected:
            return continuation(details)
        presented = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        if any(isinstance(value, str) and hmac.compare_digest(value.encode(), self._expected)
               for value in presented):
            return continuation(details)
        if details.method in self._exempt and not presented:
            return continuation(details)   # the ticket in the body decides
        return self._deny


def current_principal() -> Principal | None:
    """The caller of the call this thread serves (set by :class:`RoleAuth`)."""
    return _PRINCIPAL.get()


def bearer(metadata: Iterable[Any] | None) -> str:
    """The credential of ``authorization: Bearer <credential>`` metadata ("" if none)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""


class _RefusalLog:
    """Logs refused calls as warnings: each at first, then a count per interval, so a
    flood of bad calls does not flood the log."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._window = 0.0
        self._logged = 0
        self._quiet = 0

    def __call__(self, method: str, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window >= self._interval:
                if self._quiet:
                    log.warning("refused %d more call(s) in the last %.0f s", self._quiet, self._interval)
                self._window, self._logged, self._quiet = now, 0, 0
            self._logged += 1
            if self._logged > REFUSALS_LOGGED:
                self._quiet += 1
                return
        log.warning("refused %s from %s: %s", method, peer, reason)


class RoleAuth(ServerInterceptor):
    """Authenticate every unary call, check the role its method needs, and keep
    ``server_slots`` handler threads for memory servers. Credentials and roles are
    checked from the call's metadata before its body is deserialized: a refused call's
    bytes are never parsed.

    ``roles`` maps a method name (``RegisterServer``) to the roles that may call it
    (the first is named in refusals); a method not listed needs ``admin``. ``exempt``
    holds full method names anyone may call (health checks). ``credentials`` None:
    authentication is off and every caller may do anything. ``client_slots``: calls by
    callers other than memory servers that may run at once (0: no limit); one more is
    refused at once with ControllerBusy, so that heartbeats always
    find a free handler thread. The handler sees its caller in
    :func:`current_principal`.
    """

    def __init__(self, credentials: Credentials | None, roles: Mapping[str, tuple[str, ...]],
                 exempt: Iterable[str] = (), client_slots: int = 0) -> None:
        self._credentials = credentials
        self._roles = dict(roles)
        self._exempt = frozenset(exempt)
        self._client_slots = client_slots
        self._busy = 0
        self._lock = threading.Lock()
        self._refused = _RefusalLog()

    def _refuse(self, context: grpc.ServicerContext, method: str, exc: errors.SMBError) -> NoReturn:
        self._refused(method, context.peer(), str(exc))
        abort(context, exc)

    def _principal(self, metadata: Any) -> Principal | None:
        if self._credentials is None:
            return INSECURE
        credential = bearer(metadata)
        return self._credentials.identify(credential) if credential else None

    @staticmethod
    def _refusal(name: str, allowed: tuple[str, ...], principal: Principal | None) -> errors.SMBError | None:
        """Why a call of ``name`` by ``principal`` is refused, from its metadata alone; None
        when it may go on."""
        if principal is None:
            return errors.AuthenticationError(
                f"{name}: missing or wrong credential (clients: set SMB_TOKEN or pass "
                "token=...; memory servers: the shared secret; operators: SMB_ADMIN_TOKEN)")
        if not any(principal.has(role) for role in allowed):
            also = f" (or {' or '.join(allowed[1:])})" if len(allowed) > 1 else ""
            where = ROLE_CREDENTIALS.get(allowed[0])
            return errors.PermissionDenied(
                f"{name} needs the {allowed[0]} role{also}; this caller is {principal}"
                + (f"; {where}" if where else ""))
        return None

    def intercept_service(self, continuation: Continuation, details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(details)
        if details.method in self._exempt or handler is None or handler.unary_unary is None:
            return handler
        method = details.method
        name = method.rpartition("/")[2]
        allowed = self._roles.get(name, ("admin",))
        principal = self._principal(details.invocation_metadata)
        refusal = self._refusal(name, allowed, principal)
        if refusal is not None:
            def refuse(request: bytes, context: grpc.ServicerContext) -> NoReturn:
                self._refuse(context, name, refusal)

            # no deserializer: the body of a refused call stays bytes and is never parsed
            return grpc.unary_unary_rpc_method_handler(refuse)
        assert principal is not None
        behavior = handler.unary_unary

        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            counted = principal.role != SERVER and self._client_slots > 0
            if counted:
                with self._lock:
                    full = self._busy >= self._client_slots
                    if not full:
                        self._busy += 1
                if full:
                    self._refuse(context, name, errors.ControllerBusy(
                        f"controller busy: {self._client_slots} calls in progress; retry later"))
            token = _PRINCIPAL.set(principal)
            try:
                return behavior(request, context)
            finally:
                _PRINCIPAL.reset(token)
                if counted:
                    with self._lock:
                        self._busy -= 1

        return grpc.unary_unary_rpc_method_handler(guarded, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status code and typed name of ``exc`` (and its fields,
    where it has any: a barrier timeout's counts)."""
    name = errors.wire_class(exc).__name__
    context.set_trailing_metadata(((ERROR_KEY, name), *waits.metadata(exc)))
    context.abort(status_code_for(exc), str(exc) or name)


def typed_errors(method: Callable[[_Servicer, _Request, grpc.ServicerContext], _Response]
                 ) -> Callable[[_Servicer, _Request, grpc.ServicerContext], _Response]:
    """Decorator for servicer methods: SMBError and ValueError become typed gRPC errors."""

    @functools.wraps(method)
    def wrapper(self: _Servicer, request: _Request, context: grpc.ServicerContext) -> _Response:
        try:
            return method(self, request, context)
        except errors.SMBError as exc:
            abort(context, exc)
        except Exception as exc:  # keep serving; report the failure
            if type(exc) is Exception and not exc.args:  # grpc's own context.abort()
                raise
            log.exception("%s failed", method.__name__)
            abort(context, errors.ServerError(f"{method.__name__}: {exc}"))

    return wrapper


def make_server(max_workers: int = 32, interceptors: Iterable[ServerInterceptor] = ()) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                       interceptors=list(interceptors),
                       options=[*MESSAGE_SIZE_OPTIONS, ("grpc.so_reuseport", 0)])


def tls_settings(cfg: Any) -> TLSConfig:
    """The TLS files named by a daemon's ``tls_ca``, ``tls_cert`` and ``tls_key`` settings."""
    return TLSConfig(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)


def add_port(server: grpc.Server, address: str, tls: TLSConfig, require_client_cert: bool = False) -> int:
    """Listen on ``address`` (``host:port``): over TLS when ``tls`` is on, presenting its
    certificate and, with ``require_client_cert``, refusing peers without one signed by
    its CA. Returns the bound port (0 when binding failed). Raises InvalidArgument for
    TLS files that are missing or do not fit together."""
    if not tls.enabled:
        return int(server.add_insecure_port(address))
    tls.check(server=True)
    ca, cert, key = tls.read()
    assert cert is not None and key is not None
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                              require_client_auth=require_client_cert)
    return int(server.add_secure_port(address, credentials))
