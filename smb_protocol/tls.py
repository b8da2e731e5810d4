"""TLS settings shared by the gRPC channels and the TCP data plane.

A :class:`TLSConfig` names three PEM files: ``ca`` (the certificates this process
trusts to sign its peers' certificates), ``cert`` and ``key`` (this process's own
certificate chain and private key, presented as a client certificate, and by daemons
as their server certificate). Clients read them from ``SMB_TLS_CA``, ``SMB_TLS_CERT``
and ``SMB_TLS_KEY`` (:meth:`TLSConfig.from_env`) unless given one; daemons from their
``tls_ca``/``tls_cert``/``tls_key`` settings, whose environment variables are the same.

TLS is on when a CA is configured (a daemon also needs its certificate and key).
The contexts come from the standard library's :mod:`ssl` (OpenSSL): TLS 1.2 or later,
the peer's certificate checked against ``ca`` and its name (the host of the address
used) against the certificate's subject alternative names.

:func:`untrusted` turns a failed handshake into :class:`AuthenticationError` saying
which setting to fix. A memory server that serves TLS on its TCP data plane advertises
``tcp+tls://host:port`` instead of ``tcp://host:port``.
"""
from __future__ import annotations

import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .addressing import parse_hostport
from .errors import AuthenticationError, InvalidArgument, ServerUnavailable

log = logging.getLogger(__name__)

TLS_SCHEME = "tcp+tls"
PROBE_TIMEOUT = 1.0   # seconds a diagnosing handshake may take
PROBE_AGAIN = 0.1     # seconds before a probe the server closed is repeated
COALESCE_BYTES = 16 << 10   # bytes; frames up to this are sent as one TLS record
CA_HINT = ("point SMB_TLS_CA (tls_ca, or Client(tls=TLSConfig(ca=...))) at the CA that signed "
           "the cluster's certificates")
CERT_HINT = ("this server requires a client certificate: set SMB_TLS_CERT and SMB_TLS_KEY "
             "(tls_cert/tls_key) to a certificate signed by the cluster's CA")
PEER_HINT = ("the server does not accept this client's certificate: set SMB_TLS_CERT and "
             "SMB_TLS_KEY (tls_cert/tls_key) to a certificate signed by the CA the server trusts "
             "(its tls_ca)")
PLAIN_HINT = ("the server does not speak TLS: give it tls_ca, tls_cert and tls_key, or turn TLS "
              "off on this side (unset SMB_TLS_CA, or Client(tls=TLSConfig()))")
# OpenSSL's words in a failed handshake that mean "not trusted", on either side
_TRUST_WORDS = ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed", "UNKNOWN_CA",
                "unknown ca", "BAD_CERTIFICATE", "bad certificate", "CERTIFICATE_REQUIRED",
                "certificate required", "PEER_DID_NOT_RETURN_A_CERTIFICATE",
                "peer did not return a certificate", "HANDSHAKE_FAILURE",
                "Ssl handshake failed", "handshake failed")
_CLIENT_CERT_WORDS = ("CERTIFICATE_REQUIRED", "certificate required",
                      "PEER_DID_NOT_RETURN_A_CERTIFICATE", "peer did not return a certificate")


@dataclass(frozen=True)
class TLSConfig:
    """Paths of PEM files; all empty: TLS off. ``ca`` alone: a client that checks the
    servers but has no certificate of its own (refused by servers that require one)."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    _contexts: dict[str, ssl.SSLContext] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TLSConfig:
        """The settings in ``SMB_TLS_CA``, ``SMB_TLS_CERT`` and ``SMB_TLS_KEY``."""
        env = os.environ if env is None else env
        return cls(env.get("SMB_TLS_CA", ""), env.get("SMB_TLS_CERT", ""), env.get("SMB_TLS_KEY", ""))

    @property
    def enabled(self) -> bool:
        """True when TLS is on (a CA is configured)."""
        return bool(self.ca)

    def check(self, server: bool = False) -> None:
        """Raise InvalidArgument naming the setting when the files do not fit together:
        a certificate without a key (or the reverse), a daemon without its own
        certificate, or a file that cannot be read."""
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("TLS needs both a certificate and its key (tls_cert and tls_key, "
                                  "SMB_TLS_CERT and SMB_TLS_KEY), or neither")
        if (self.cert or server) and not self.ca:
            raise InvalidArgument("TLS needs the CA that signs the cluster's certificates "
                                  "(tls_ca, SMB_TLS_CA)")
        if server and not self.cert:
            raise InvalidArgument("a daemon serving TLS needs its certificate and key "
                                  "(tls_cert and tls_key, SMB_TLS_CERT and SMB_TLS_KEY)")
        for what, path in (("tls_ca", self.ca), ("tls_cert", self.cert), ("tls_key", self.key)):
            if path and not os.access(path, os.R_OK):
                raise InvalidArgument(f"{what}: cannot read {path}")

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """(CA, certificate, key) PEM bytes, for gRPC; None where not configured."""
        def load(path: str) -> bytes | None:
            if not path:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise InvalidArgument(f"cannot read TLS file {path}: {exc.strerror}") from None
        ca = load(self.ca)
        return ca or b"", load(self.cert), load(self.key)

    def client_context(self) -> ssl.SSLContext:
        """The context of a client socket (made once): checks the server against ``ca``
        (the system's CAs when none is configured) and presents ``cert`` if set."""
        ctx = self._contexts.get("client")
        if ctx is None:
            self.check()
            ctx = self._context(ssl.Purpose.SERVER_AUTH)
            self._contexts["client"] = ctx
        return ctx

    def server_context(self, require_client_cert: bool = False) -> ssl.SSLContext:
        """The context of a daemon's listening side (made once per flavour): presents
        ``cert``; with ``require_client_cert`` refuses peers without a certificate
        signed by ``ca``."""
        name = "server-mtls" if require_client_cert else "server"
        ctx = self._contexts.get(name)
        if ctx is None:
            self.check(server=True)
            ctx = self._context(ssl.Purpose.CLIENT_AUTH)
            ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
            self._contexts[name] = ctx
        return ctx

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        """A context that trusts ``ca`` (the system's CAs when none) and holds ``cert``;
        files that are not PEM, or a key that is not the certificate's, raise
        InvalidArgument naming them."""
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca or None)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            files = ", ".join(p for p in (self.ca, self.cert, self.key) if p)
            raise InvalidArgument(f"TLS files {files}: {exc} (PEM CA, certificate and its "
                                  "private key expected)") from None
        return ctx


def is_trust_failure(text: str) -> bool:
    """True when an error text from OpenSSL or gRPC says a handshake failed."""
    return any(w in text for w in _TRUST_WORDS)


def untrusted(where: str, detail: str) -> AuthenticationError:
    """The error for a refused TLS handshake with ``where`` (``tcp+tls://h:p``, a
    controller address), saying which settings to fix."""
    if "WRONG_VERSION_NUMBER" in detail:   # the peer answered in clear text
        hint = PLAIN_HINT
    elif any(w in detail for w in _CLIENT_CERT_WORDS):
        hint = CERT_HINT
    elif "_ALERT_" in detail:   # the server's alert: it refused what we presented
        hint = PEER_HINT
    else:
        hint = f"{CA_HINT}; if the server requires client certificates, also SMB_TLS_CERT and SMB_TLS_KEY"
    return AuthenticationError(f"{where}: TLS handshake refused ({detail.strip()}); {hint}")


def _probe_context(tls: TLSConfig) -> ssl.SSLContext:
    """A client context like :meth:`TLSConfig.client_context`, speaking HTTP/2 (gRPC);
    with TLS off, one that checks nothing (it only asks whether the server speaks TLS)."""
    if not tls.enabled:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
        if tls.cert:
            ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


def diagnose(address: str, tls: TLSConfig, timeout: float = PROBE_TIMEOUT) -> AuthenticationError | None:
    """Why the gRPC server at ``host:port`` closed a connection at once, when TLS is why:
    it serves TLS and ``tls`` is off, it does not trust our certificate (or wants one),
    or we do not trust its. None when a probe handshake finds nothing wrong (or the
    server cannot be reached): the caller's own error stands. A server that closes a
    probe right after the handshake is probed once more (a server stopping closes
    connections too), and blamed only when it does so again. Takes at most a few
    ``timeout`` seconds."""
    verdict, closed = _probe(address, tls, timeout)
    if closed:
        time.sleep(PROBE_AGAIN)
        again, closed_again = _probe(address, tls, timeout)
        return verdict if closed_again else again
    return verdict


def _probe(address: str, tls: TLSConfig, timeout: float) -> tuple[AuthenticationError | None, bool]:
    """One probe handshake: (the refusal it shows or None, whether the server closed the
    connection without a word right after the handshake)."""
    try:
        host, port = parse_hostport(address)
        sock = socket.create_connection((host, port), timeout)
    except (OSError, InvalidArgument):
        return None, False
    try:
        ctx = _probe_context(tls)
        try:
            ssock = ctx.wrap_socket(sock, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            return untrusted(address, str(exc)), False
        except (ssl.SSLError, OSError):
            return None, False
        with ssock:
            if not tls.enabled:
                return AuthenticationError(f"{address} serves TLS and this process has TLS off; "
                                           f"{CA_HINT}"), False
            try:
                first = ssock.recv(1)   # the server's first HTTP/2 frame, or its refusal of us
            except ssl.SSLError as exc:
                if is_trust_failure(str(exc)) or "ALERT" in str(exc):
                    return untrusted(address, str(exc)), False
                return None, False
            except OSError:
                return None, False
            if first:
                return None, False
            # closed without a word right after the handshake: our certificate was refused
            if not tls.cert:
                return untrusted(address, "closed after the handshake: certificate required"), True
            return AuthenticationError(f"{address}: the server closed the connection after the "
                                       f"TLS handshake: {PEER_HINT} (this one: {tls.cert})"), True
    finally:
        sock.close()


# -- streams ------------------------------------------------------------------------
# TLS sockets have neither sendmsg nor recvmsg_into: the data plane's framing helpers
# (smb_protocol.wire) hand TLS sockets to these loops. OpenSSL encrypts from and decrypts
# into the caller's buffers; small frames are joined first so that a request and its
# small payload travel in one TLS record.

def send_all(sock: ssl.SSLSocket, buffers: Sequence[memoryview | bytes],
             on_stall: Callable[[float], None] | None = None) -> None:
    """Send every buffer, in order, over a TLS socket; ``on_stall`` as in
    :func:`smb_protocol.wire.sendmsg_all` (a write that timed out is made again with the
    same bytes, as OpenSSL requires)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if sum(len(v) for v in views) <= COALESCE_BYTES:
        views = [memoryview(b"".join(views))]
    if on_stall is None:
        for view in views:
            sock.sendall(view)
        return
    since = time.monotonic()
    for view in views:
        while len(view):
            try:
                view = view[sock.send(view):]
            except TimeoutError as exc:
                if exc.errno is not None:
                    raise
                on_stall(time.monotonic() - since)
                continue
            since = time.monotonic()


def recv_into_all(sock: ssl.SSLSocket, buffers: Sequence[memoryview],
                  deadline: float | None = None) -> None:
    """Fill every buffer, in order, from a TLS socket; ``deadline`` as in
    :func:`smb_protocol.wire.recv_into_all`. Raises ServerUnavailable on a closed stream."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the frame's deadline passed")
                sock.settimeout(left)
            got = sock.recv_into(view)
            if got == 0:
                raise ServerUnavailable("connection closed by peer")
            view = view[got:]
