"""Certificates and node keys for TLS deployments (``diff2 certs``).

A throw-away CA and a SuperLink certificate, and one SuperNode key pair per data owner for Flower's
SuperNode authentication: ``supernode-<i>.key`` (EC P-384, OpenSSH format, mode 0600: it stays on data
owner i's machine) and ``supernode-<i>.pub`` (registered with the SuperLink by the operator, through
``flwr supernode register``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Certificates", "NodeKey", "make_certificates", "make_node_keys", "node_key_names"]


@dataclass(frozen=True)
class Certificates:
    ca: Path
    cert: Path
    key: Path


def _subject_alt_name(host: str):
    """An IP address (IPv4 or IPv6, brackets allowed) as an IPAddress entry, anything else as a DNS name."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(folder: str | os.PathLike[str], hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Certificates:
    """A self-signed CA and a server certificate for ``hosts`` (for tests and local deployments only)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diff2-flwr local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_subject_alt_name(h) for h in hosts]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    out = Certificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(out.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
    return out


@dataclass(frozen=True)
class NodeKey:
    private: Path
    public: Path


def node_key_names(i: int) -> tuple[str, str]:
    """File names of data owner ``i``'s SuperNode key pair (private, public)."""
    return f"supernode-{i}.key", f"supernode-{i}.pub"


def make_node_keys(folder: str | os.PathLike[str], clients: int) -> list[NodeKey]:
    """One SuperNode key pair per data owner, in the format Flower 1.42 reads.

    ``flower-supernode --auth-supernode-private-key`` loads an OpenSSH EC private key and
    ``flwr supernode register`` an OpenSSH public key on a NIST curve; P-384 as in Flower's guide.
    Existing files are replaced: a new pair must be registered again.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if clients < 1:
        raise ValueError(f"`clients` (data owners needing a SuperNode key) must be >= 1. Found {clients}.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keys = []
    for i in range(clients):
        private_name, public_name = node_key_names(i)
        key = ec.generate_private_key(ec.SECP384R1())
        out = NodeKey(folder / private_name, folder / public_name)
        _write_private(out.private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                      serialization.NoEncryption()))
        out.public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                             serialization.PublicFormat.OpenSSH) + b"\n")
        keys.append(out)
    return keys


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (0600 from creation, not after the fact)."""
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
