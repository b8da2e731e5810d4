"""Throw-away certificates for a local cluster (``smb up --tls``) and for tests.

:func:`make_cluster_certs` writes, into one directory, a fresh CA (``ca.pem``, its key
``ca.key``), one certificate for the daemons (``server.pem``/``server.key``, valid for
TLS servers and clients, with subject alternative names for ``localhost``,
``127.0.0.1``, ``::1``, this host's name and any given) and one client certificate
(``client.pem``/``client.key``). Keys are ECDSA P-256, written with mode 0600.
Made with the ``cryptography`` package; production clusters use certificates from
their own CA instead (see docs/operations.md).
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from smb_protocol.tls import TLSConfig

log = logging.getLogger(__name__)

VALID_DAYS = 30          # days a throw-away certificate is valid (smb up --tls)
KEY_MODE = 0o600         # permissions of private key files


@dataclass(frozen=True)
class ClusterCerts:
    """Paths of the files :func:`make_cluster_certs` wrote."""

    directory: str
    ca: str
    ca_key: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def daemon(self) -> TLSConfig:
        """What the controller and the memory servers use."""
        return TLSConfig(self.ca, self.server_cert, self.server_key)

    def client(self) -> TLSConfig:
        """What a client uses (its certificate satisfies servers that require one)."""
        return TLSConfig(self.ca, self.client_cert, self.client_key)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Soft Memory Box"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write(path: str, data: bytes, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    seen = set()
    for host in hosts:
        host = host.strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _issue(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, common: str,
           hosts: Iterable[str], usages: list[x509.ObjectIdentifier],
           now: datetime.datetime, days: int) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(_name(common)).issuer_name(ca_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    sans = _sans(hosts)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def make_cluster_certs(directory: str, hosts: Iterable[str] = (), days: int = VALID_DAYS) -> ClusterCerts:
    """Write a fresh CA and a daemon and a client certificate into ``directory``
    (created), valid for ``days``; the daemon certificate names ``hosts`` besides the
    local names."""
    os.makedirs(directory, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("smb throw-away CA")
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True, crl_sign=True,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    paths = ClusterCerts(directory, *(os.path.join(directory, n) for n in (
        "ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")))
    _write(paths.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    _write(paths.ca_key, _key_pem(ca_key), KEY_MODE)
    local = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert, key = _issue(ca_key, ca_name, "smb daemon", [*local, *hosts], both, now, days)
    _write(paths.server_cert, cert)
    _write(paths.server_key, key, KEY_MODE)
    cert, key = _issue(ca_key, ca_name, "smb client", [], [ExtendedKeyUsageOID.CLIENT_AUTH], now, days)
    _write(paths.client_cert, cert)
    _write(paths.client_key, key, KEY_MODE)
    log.info("wrote a throw-away CA and certificates to %s", directory)
    return paths
