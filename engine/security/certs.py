"""Certificates and keys of a federation, made with the ``cryptography`` package.

Who holds what::

    coordinator   ca.pem, ca.key          the federation's certificate authority (key stays here)
                  server.pem, server.key  TLS certificate of the coordinator, signed by the CA
    every site    ca.pem                  to verify the coordinator (copied from the coordinator)
                  <site>.key              the site's private key (never leaves the site)
                  <site>.pub.pem          its public key, handed to the coordinator for enrolment

TLS authenticates the coordinator to the sites; a site authenticates itself by signing every
request with its private key (Flower's SuperNode authentication), and the coordinator only
accepts keys it enrolled. All keys are ECDSA on NIST P-384, the curve Flower's SuperNode
authentication accepts. Private keys are written with mode 0600 and no passphrase, because
they are read by unattended processes; protect the folders that hold them.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from engine.bundle import check_site_name
from engine.errors import ConfigError
from engine.io.atomic import write_bytes_atomic

#: Names the coordinator's certificate is always valid for: the coordinator reaches its own
#: SuperLink on the loopback interface.
LOOPBACK_NAMES = ("127.0.0.1", "localhost")
_CURVE = ec.SECP384R1


@dataclass(frozen=True)
class CertificatePaths:
    """Where a certificate and its private key are."""

    cert: Path
    key: Path


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_private(path: Path, data: bytes) -> None:
    # mkstemp (inside the atomic write) creates the file 0600, and the rename keeps the mode
    write_bytes_atomic(path, data)
    os.chmod(path, 0o600)


def write_public(path: Path, data: bytes) -> None:
    """Write a certificate or public key atomically, readable by everyone (0644)."""
    write_bytes_atomic(path, data)
    os.chmod(path, 0o644)


def _refuse_overwrite(paths: list[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s); pass --force to replace them "
                          "(sites and enrolments that use them must then be updated)")


def create_ca(out_dir: Path, name: str = "FedSM federation CA", days: int = 3650,
              force: bool = False) -> CertificatePaths:
    """Create a self-signed federation CA: ``ca.pem`` and ``ca.key`` in ``out_dir``."""
    out_dir = Path(out_dir)
    paths = CertificatePaths(out_dir / "ca.pem", out_dir / "ca.key")
    _refuse_overwrite([paths.cert, paths.key], force)
    if days < 1:
        raise ConfigError(f"--days must be >= 1, got {days}")
    key = ec.generate_private_key(_CURVE())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA384())
    )
    _write_private(paths.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    write_public(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return paths


def _san_entry(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        if not host or any(c.isspace() for c in host) or "/" in host or ":" in host:
            raise ConfigError(f"{host!r} is neither an IP address nor a host name; give the name or address "
                              "sites use to reach the coordinator, e.g. coordinator.example.org") from None
        return x509.DNSName(host)


def create_server_certificate(ca_dir: Path, out_dir: Path, hosts: list[str], days: int = 825,
                              force: bool = False) -> CertificatePaths:
    """Create the coordinator's TLS certificate, signed by the CA in ``ca_dir``.

    Parameters
    ----------
    hosts
        Names and addresses the sites use to reach the coordinator; ``127.0.0.1`` and
        ``localhost`` are always added.
    """
    ca_cert, ca_key = load_ca(ca_dir)
    out_dir = Path(out_dir)
    paths = CertificatePaths(out_dir / "server.pem", out_dir / "server.key")
    _refuse_overwrite([paths.cert, paths.key], force)
    names = list(dict.fromkeys([*hosts, *LOOPBACK_NAMES]))
    key = ec.generate_private_key(_CURVE())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_san_entry(h) for h in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )
    _write_private(paths.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    write_public(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    return paths


def create_site_keys(name: str, out_dir: Path, force: bool = False) -> CertificatePaths:
    """Create a site's key pair: ``<name>.key`` (OpenSSH, 0600) and ``<name>.pub.pem``.

    Returns
    -------
    CertificatePaths
        ``cert`` is the public key file (the one to hand to the coordinator).
    """
    check_site_name(name)
    out_dir = Path(out_dir)
    paths = CertificatePaths(out_dir / f"{name}.pub.pem", out_dir / f"{name}.key")
    _refuse_overwrite([paths.cert, paths.key], force)
    key = ec.generate_private_key(_CURVE())
    # Flower's SuperNode reads its private key in OpenSSH format
    _write_private(paths.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                                serialization.NoEncryption()))
    write_public(paths.cert, public_key_pem(key.public_key()))
    return paths


def public_key_pem(key: ec.EllipticCurvePublicKey) -> bytes:
    """PEM (SubjectPublicKeyInfo) bytes of a public key: the form Flower registers."""
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(path: Path) -> ec.EllipticCurvePublicKey:
    """Read a site's public key (PEM) and check it can authenticate a SuperNode."""
    path = Path(path)
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"public key {path} does not exist; create it at the site with "
                          "'fedsm certs site --name NAME --out DIR'") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{path} is not a PEM public key ({exc}); send the '<site>.pub.pem' file "
                          "that 'fedsm certs site' wrote, not the private key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
            key.curve, ec.SECP256R1 | ec.SECP384R1 | ec.SECP521R1):
        raise ConfigError(f"{path}: SuperNode authentication needs an ECDSA key on a NIST curve (P-256, P-384 "
                          "or P-521); create one with 'fedsm certs site'")
    return key


def load_site_private_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """Read a site's private key (OpenSSH format) and check it is usable for authentication."""
    path = Path(path)
    try:
        key = serialization.load_ssh_private_key(path.read_bytes(), None)
    except FileNotFoundError:
        raise ConfigError(f"private key {path} does not exist; create it with 'fedsm certs site'") from None
    except (ValueError, UnsupportedAlgorithm, TypeError) as exc:
        raise ConfigError(f"{path} is not an unencrypted OpenSSH private key ({exc}); create one with "
                          "'fedsm certs site'") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{path}: SuperNode authentication needs an ECDSA key; create one with 'fedsm certs site'")
    return key


def key_fingerprint(key: ec.EllipticCurvePublicKey) -> str:
    """``SHA256:<hex>`` of the key's DER encoding, to compare a key over the phone."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "SHA256:" + hashlib.sha256(der).hexdigest()


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key in ``ca_dir`` (``ca.pem``, ``ca.key``)."""
    ca_dir = Path(ca_dir)
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc.filename} does not exist; create the CA first with "
                          f"'fedsm certs ca --out {ca_dir}'") from None
    except ValueError as exc:
        raise ConfigError(f"{ca_dir}: unreadable CA files ({exc}); recreate them with 'fedsm certs ca'") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{ca_dir / 'ca.key'} is not an ECDSA key; recreate the CA with 'fedsm certs ca'")
    return cert, key


def check_server_certificate(ca_cert: Path, cert: Path, key: Path, host: str) -> None:
    """Raise :class:`ConfigError` unless ``cert`` is signed by ``ca_cert``, valid now, for ``host``, with ``key``."""
    try:
        ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        leaf = x509.load_pem_x509_certificate(Path(cert).read_bytes())
        private = serialization.load_pem_private_key(Path(key).read_bytes(), None)
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc.filename} does not exist; create the certificates with 'fedsm certs ca' and "
                          "'fedsm certs server' (see docs/federation.md)") from None
    except ValueError as exc:
        raise ConfigError(f"unreadable certificate or key ({exc}); recreate them with 'fedsm certs server'") from None
    der = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private.public_key().public_bytes(*der) != leaf.public_key().public_bytes(*der):
        raise ConfigError(f"{key} does not belong to {cert}; use the key written together with the certificate")
    try:
        leaf.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"{cert} is not signed by the CA {ca_cert}; recreate it with "
                          "'fedsm certs server --ca <the CA folder>'") from None
    now = _now()
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise ConfigError(f"{cert} is valid from {leaf.not_valid_before_utc:%Y-%m-%d} to "
                          f"{leaf.not_valid_after_utc:%Y-%m-%d}, not now; create a new one with 'fedsm certs server'")
    if not certificate_covers(leaf, host):
        raise ConfigError(f"{cert} is not valid for {host!r} (it names {', '.join(certificate_names(leaf))}); "
                          f"create it with 'fedsm certs server --host {host}'")


def certificate_names(cert: x509.Certificate) -> list[str]:
    """DNS names and IP addresses in a certificate's subject alternative names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]


def certificate_covers(cert: x509.Certificate, host: str) -> bool:
    """Whether ``host`` (name or address) is one of the certificate's names (no wildcards)."""
    if host in ("0.0.0.0", "::"):
        # binding every interface: the certificate must name the addresses sites use, not this
        return True
    return host in certificate_names(cert)
