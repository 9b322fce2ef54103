"""Certificates and node keys for TLS deployments (``diff2 certs``, ``diff2 node-key``).

A throw-away CA and a SuperLink certificate (the CA's key is never written), and SuperNode key pairs
for Flower's SuperNode authentication: ``<name>.key`` (EC P-384, OpenSSH format, 0600 in a 0700
folder) and ``<name>.pub`` (registered with the SuperLink by the operator, ``flwr supernode
register``). In a real federation each data owner makes its own pair (:func:`make_node_key`, ``diff2
node-key``) and sends only the public key; the operator checks the public keys it receives
(:func:`load_node_public_keys`). :func:`make_node_keys` makes every pair on one machine: for
one-machine tests only (whoever runs it holds every data owner's private key).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (Encoding, PublicFormat,
                                                          load_ssh_public_key)
from cryptography.x509.oid import NameOID

from ..runtime.secret_files import private_folder, write_private

__all__ = ["Certificates", "NodeKey", "load_node_public_keys", "make_certificates", "make_node_key",
           "make_node_keys",
           "node_key_names"]


@dataclass(frozen=True)
class Certificates:
    """The files :func:`make_certificates` wrote: the CA's certificate (what clients verify
    against), the SuperLink's certificate and its private key (0600)."""

    ca: Path
    cert: Path
    key: Path


def _subject_alt_name(host: str):
    """An IP address (IPv4 or IPv6, brackets allowed) as an IPAddress entry, anything else as a DNS
    name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def make_certificates(folder: str | os.PathLike[str],
                      hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Certificates:
    """A self-signed CA and a server certificate for ``hosts`` (for tests and local deployments
    only)."""
    folder = private_folder(folder)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diff2-flwr local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(
        ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(
              minutes=5))
          .not_valid_after(now + datetime.timedelta(days=30))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_subject_alt_name(h) for h in hosts]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                        hosts[0])])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
                now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    out = Certificates(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(out.key, key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    return out


#: The curves `flwr supernode register` accepts.
_NIST_CURVES = ("secp256r1", "secp384r1", "secp521r1")


@dataclass(frozen=True)
class NodeKey:
    """One SuperNode key pair's files: the private key (0600, stays with its data owner) and the
    public key (registered with the SuperLink)."""

    private: Path
    public: Path


def node_key_names(i: int) -> tuple[str, str]:
    """File names of data owner ``i``'s SuperNode key pair (private, public)."""
    return f"supernode-{i}.key", f"supernode-{i}.pub"


def make_node_key(folder: str | os.PathLike[str], name: str = "supernode") -> NodeKey:
    """One SuperNode key pair, ``<name>.key`` (0600) and ``<name>.pub``, in ``folder`` (made 0700).

    ``flower-supernode --auth-supernode-private-key`` loads an OpenSSH EC private key and
    ``flwr supernode register`` an OpenSSH public key on a NIST curve; P-384 as in Flower's guide.
    Existing files are replaced: a new pair must be registered again.
    """
    folder = private_folder(folder)
    key = ec.generate_private_key(ec.SECP384R1())
    out = NodeKey(folder / f"{name}.key", folder / f"{name}.pub")
    write_private(out.private, key.private_bytes(serialization.Encoding.PEM,
                                                 serialization.PrivateFormat.OpenSSH,
                                                 serialization.NoEncryption()))
    out.public.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return out


def make_node_keys(folder: str | os.PathLike[str], clients: int) -> list[NodeKey]:
    """One SuperNode key pair per data owner, ``supernode-<i>.key/.pub``: for one-machine tests
    only.

    Whoever runs this holds every data owner's private key and can act as any of them; in a real
    federation each data owner runs :func:`make_node_key` (``diff2 node-key``) on its own machine.
    """
    if clients < 1:
        raise ValueError(
            f"`clients` (data owners needing a SuperNode key) must be >= 1. Found {clients}.")
    return [make_node_key(folder,
                          node_key_names(i)[0].removesuffix(".key")) for i in range(clients)]


def load_node_public_keys(files: list[str | os.PathLike[str]]) -> list[bytes]:
    """The data owners' public keys as ``flwr supernode register`` reads them; a file that is not
    one is refused.

    A private key sent by mistake is refused too (it must stay with its data owner: make a new
    pair).
    """
    loaded = []
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise ValueError(
                f"{path}: no such file (a data owner's SuperNode public key, `diff2 node-key` "
                f"writes it).")
        data = path.read_bytes()
        if b"PRIVATE KEY" in data:
            raise ValueError(
                f"{path} is a private key. The data owner keeps that file and sends only its .pub "
                             "file; a private key that left its owner's machine is compromised: "
                             "make a new pair "
                             "(`diff2 node-key`) and send its .pub.")
        try:
            key = load_ssh_public_key(data)
        except (ValueError, TypeError) as err:
            key, why = None, str(err)
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _NIST_CURVES:
            found = (f"an {type(key).__name__}" if key is not None
                     and not isinstance(key, ec.EllipticCurvePublicKey)
                     else f"curve {key.curve.name}" if key is not None else why)
            raise ValueError(
                f"{path}: expected a SuperNode public key (OpenSSH, EC on a NIST curve, as `diff2 "
                             f"node-key` writes it; Flower refuses others). Found {found}. Ask "
                             f"the data owner for "
                             "the .pub file `diff2 node-key` wrote.")
        loaded.append(key.public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH))
    if len(set(loaded)) < len(loaded):
        raise ValueError(
            f"Two of {[str(f) for f in files]} hold the same public key: each data owner needs a "
            f"pair "
                         "of its own.")
    return loaded
