"""Authenticate a fleet request from its headers, before its body is read.

Flower's HTTP Fleet API (1.41, 1.42) authenticates a SuperNode with three headers: its public key
(``flwr-public-key``, PEM, base64), a timestamp (``flwr-timestamp``) and its signature of the
timestamp (``flwr-signature``); the body is not signed. Flower checks them only after the
body has been read and parsed, so anyone who reaches the sites' address can make the
SuperLink receive and hold bodies. :class:`HeaderAuth` makes the same check (enrolled key,
signature, timestamp within Flower's tolerance) on the headers alone, so the fleet listener
(:class:`.fleet_listener.FleetOnly`) answers an unauthenticated request 401 without reading a
byte of its body. Flower checks again as before (and also that the key belongs to the node
the request names).

The header names, the signature (ECDSA with SHA-256 over the timestamp's text) and the
timestamp's tolerance are Flower's wire protocol, written out here rather than taken from
Flower's internal modules; ``tests/federation/test_upload_limits.py`` signs with Flower's own
code and compares the constants with the installed Flower's, so a Flower that changes them fails
there.
"""

from __future__ import annotations

import binascii
import datetime as dt
from base64 import b64decode
from collections.abc import Iterable
from pathlib import Path

from engine.federation.flower.asgi import Scope
from engine.io.atomic import write_bytes_atomic

#: Flower's Fleet API authentication headers (lower case, as an ASGI scope carries them).
PUBLIC_KEY_HEADER = "flwr-public-key"
SIGNATURE_HEADER = "flwr-signature"
TIMESTAMP_HEADER = "flwr-timestamp"
#: How old a signed timestamp Flower's SuperLink accepts (s), and the clock skew it allows either way (s).
TIMESTAMP_TOLERANCE_S = 300
CLOCK_SKEW_S = 5


def _spki(pem: bytes) -> bytes | None:
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        return None
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class HeaderAuth:
    """Accept a fleet request only if its headers carry a valid signature by an enrolled key.

    Parameters
    ----------
    public_keys
        The enrolled sites' public keys (PEM).
    """

    def __init__(self, public_keys: Iterable[bytes]) -> None:
        self._keys = {der for der in (_spki(pem) for pem in public_keys) if der is not None}

    @classmethod
    def from_file(cls, path: Path) -> HeaderAuth:
        """Keys from a file of concatenated PEM public keys (:func:`write_keys`)."""
        text = Path(path).read_bytes()
        marker = b"-----END PUBLIC KEY-----"
        return cls(part.strip() + b"\n" + marker + b"\n" for part in text.split(marker) if part.strip())

    def allowed(self, scope: Scope) -> bool:
        """Whether the request's headers authenticate an enrolled node (no body needed)."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        headers = {name.decode("latin-1").lower(): value for name, value in scope.get("headers", ())}
        try:
            public_key = b64decode(headers[PUBLIC_KEY_HEADER], validate=True)
            signature = b64decode(headers[SIGNATURE_HEADER], validate=True)
            timestamp = headers[TIMESTAMP_HEADER].decode("ascii")
            if _spki(public_key) not in self._keys:
                return False
            signed_at = dt.datetime.fromisoformat(timestamp)
            age = (dt.datetime.now(dt.UTC) - signed_at).total_seconds()
            if not -CLOCK_SKEW_S < age < TIMESTAMP_TOLERANCE_S + CLOCK_SKEW_S:
                return False
            key = serialization.load_pem_public_key(public_key)
            if not isinstance(key, ec.EllipticCurvePublicKey):
                return False
            key.verify(signature, timestamp.encode("ascii"), ec.ECDSA(hashes.SHA256()))
            return True
        except (KeyError, ValueError, TypeError, UnicodeError, binascii.Error, InvalidSignature):
            return False


def write_keys(path: Path, public_keys: Iterable[bytes]) -> Path:
    """Write the enrolled keys for the SuperLink's fleet listener (public data, written atomically)."""
    write_bytes_atomic(path, b"".join(pem.strip() + b"\n" for pem in public_keys))
    return Path(path)
