"""The signed run spec: the coordinator signs the run's settings; a site checks them against its own bounds.

App approval pins the code a site runs; the run's settings (method, hyper-parameters, rounds,
image size) decide what that code does with the site's data. The coordinator puts them, with
the app's hash and the run's session, into an envelope signed with its TLS key (the key the
federation CA certified for the coordinator; ECDSA P-384 with SHA-384) and attaches its
certificate. The envelope travels as the run's configuration (Flower's ``override_config``,
key :data:`RUN_CONFIG_KEY`), which a site's SuperNode reads before it pulls any message
payload.

A site (:func:`verify_envelope`) checks that the certificate was issued by its federation CA
(``[security] ca_cert``) and is valid now, that the signature covers exactly these settings,
that the signed app hash is the app being run, and that the settings stay within the
``[bounds]`` of its ``site.toml`` (:class:`SiteBounds`). Anything else is refused before a
byte of the payload is pulled, and every message's own copy of the settings must equal the
signed one. In ``--insecure`` demonstrations there are no certificates: the envelope is not
signed, and the bounds are still checked.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.catalogue import federation_methods
from engine.errors import ConfigError, FedSMError
from engine.fl.registry import EXCHANGE_METHODS
from engine.fl.selector_schemes import default_selector_lr

ENVELOPE_FORMAT = "fedsm-signed-run-spec/1"
#: Key of the run configuration that carries the envelope (declared in the FAB's pyproject).
RUN_CONFIG_KEY = "fedsm_run_spec"
_DOMAIN = b"fedsm run spec v1\n"
#: Start of the SuperNode's output line that tells the site process it refused a run's settings.
REFUSED_SPEC = "FEDSM-REFUSED-SPEC"


class RunSpecRefused(FedSMError):
    """A run's settings are unsigned, badly signed, or outside this site's bounds."""


@dataclass(frozen=True)
class SiteBounds:
    """The ``[bounds]`` table of ``site.toml``: what this site agrees to run (every key optional)."""

    #: ``None``: every method this installation can run over the network
    allowed_methods: tuple[str, ...] | None = None
    max_rounds: int = 1000
    max_epochs: int = 20
    max_lr: float = 0.01
    max_selector_lr: float = 0.01
    max_image_size: int = 1024
    max_batch_size: int = 256
    min_batch_size: int = 1
    #: FedSM personalization rules this site agrees to train (``None``: all). A rule decides what
    #: the site keeps and what it sends (docs/federation.md, "What leaves a site").
    allowed_personalizations: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, table: Mapping[str, Any] | None, where: str = "[bounds]") -> SiteBounds:
        table = dict(table or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(table) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        out: dict[str, Any] = {}
        for key, value in table.items():
            default = getattr(cls, key, None)
            if key in ("allowed_methods", "allowed_personalizations"):
                if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
                    raise ConfigError(f"{where}: {key} must be a list of names")
                if key == "allowed_personalizations":
                    from engine.fl.personalization import check_personalization

                    for rule in value:
                        check_personalization(rule)
                out[key] = tuple(value)
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or value <= 0 or (isinstance(default, int) and not isinstance(value, int)):
                raise ConfigError(f"{where}: {key} = {value!r} must be a positive "
                                  f"{'integer' if isinstance(default, int) else 'number'}")
            else:
                out[key] = value
        return cls(**out)

    def violations(self, spec: Mapping[str, Any]) -> list[str]:
        """What in the run's settings ``spec`` (a MethodSpec as a dict) breaks these bounds."""
        out = []
        allowed = ((*federation_methods(), *EXCHANGE_METHODS) if self.allowed_methods is None
                   else self.allowed_methods)
        if spec.get("method") not in allowed:
            out.append(f"method {spec.get('method')!r} is not in allowed_methods {list(allowed)}")
        rule = spec.get("personalization", "softpull")
        if self.allowed_personalizations is not None and rule not in self.allowed_personalizations:
            out.append(f"personalization {rule!r} is not in allowed_personalizations "
                       f"{list(self.allowed_personalizations)}")
        for key, bound, above in (("rounds", self.max_rounds, True), ("epochs", self.max_epochs, True),
                                  ("lr", self.max_lr, True), ("selector_lr", self.max_selector_lr, True),
                                  ("image_size", self.max_image_size, True), ("batch_size", self.max_batch_size, True),
                                  ("batch_size", self.min_batch_size, False)):
            value = spec.get(key)
            if key == "selector_lr" and value is None:
                # unset: the selector scheme's default lr (engine.fl.selector_training), which is what trains

                try:
                    value = default_selector_lr(str(spec.get("selector_calibration", "none")))
                except ConfigError:
                    value = None
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                out.append(f"{key} = {value!r} is not a number")
            elif (value > bound) if above else (value < bound):
                out.append(f"{key} = {value} is {'above max' if above else 'below min'}_{key} = {bound}")
        return out


def _message(spec_json: str, app_hash: str, session: str) -> bytes:
    return _DOMAIN + json.dumps({"spec": spec_json, "app_hash": app_hash, "session": session},
                                sort_keys=True, separators=(",", ":")).encode()


def make_envelope(spec_json: str, app_hash: str, session: str, key_path: Path | None = None,
                  cert_path: Path | None = None) -> str:
    """The run's settings as an envelope; signed with the coordinator's key when ``key_path`` is given."""
    envelope: dict[str, Any] = {"format": ENVELOPE_FORMAT, "spec": spec_json, "app_hash": app_hash,
                                "session": session, "signature": None, "certificate": None}
    if key_path is not None and cert_path is not None:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key_path} is not the coordinator's EC private key")
        signature = key.sign(_message(spec_json, app_hash, session), ec.ECDSA(hashes.SHA384()))
        envelope["signature"] = base64.b64encode(signature).decode()
        envelope["certificate"] = Path(cert_path).read_text()
    return json.dumps(envelope, sort_keys=True)


def verify_envelope(envelope_json: object, *, ca_cert: Path | None, app_hash: str | None,
                    bounds: SiteBounds) -> dict[str, Any]:
    """Check a run's envelope at a site; return the settings (a dict) or raise :class:`RunSpecRefused`.

    Parameters
    ----------
    ca_cert
        The site's federation CA certificate; ``None`` (insecure mode only) skips the signature.
    app_hash
        The hash of the app bundle being run (``None``: not checked).
    """
    try:
        envelope = json.loads(envelope_json) if isinstance(envelope_json, str) else None
    except ValueError:
        envelope = None
    if not isinstance(envelope, dict) or envelope.get("format") != ENVELOPE_FORMAT:
        raise RunSpecRefused("the run carries no readable run spec from the coordinator; refusing it")
    spec_json, signed_app, session = envelope.get("spec"), envelope.get("app_hash"), envelope.get("session")
    if not all(isinstance(v, str) for v in (spec_json, signed_app, session)):
        raise RunSpecRefused("the run spec is incomplete; refusing the run")
    if ca_cert is not None:  # a secure site: only the coordinator's signature is accepted
        _check_signature(envelope, ca_cert, _message(spec_json, signed_app, session))
    if app_hash is not None and signed_app != app_hash:
        raise RunSpecRefused(f"the run spec was signed for app {signed_app}, but the run is of app {app_hash}")
    try:
        spec = json.loads(spec_json)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise RunSpecRefused("the run spec's settings are not readable")
    broken = bounds.violations(spec)
    if broken:
        raise RunSpecRefused("the run's settings break this site's [bounds] in site.toml: " + "; ".join(broken))
    return {"spec": spec, "spec_json": spec_json, "app_hash": signed_app, "session": session,
            "signed": envelope.get("signature") is not None}


def _check_signature(envelope: Mapping[str, Any], ca_cert: Path, message: bytes) -> None:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    cert_pem, signature = envelope.get("certificate"), envelope.get("signature")
    if not isinstance(cert_pem, str) or not isinstance(signature, str):
        raise RunSpecRefused("the run spec is not signed by the coordinator; refusing the run")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
        ca = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        cert.verify_directly_issued_by(ca)
        raw = base64.b64decode(signature, validate=True)
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise RunSpecRefused("the run spec's certificate does not hold an EC key")
        key.verify(raw, message, ec.ECDSA(hashes.SHA384()))
    except RunSpecRefused:
        raise
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise RunSpecRefused(f"the run spec's signature does not verify against this site's federation CA "
                             f"({type(exc).__name__}); the settings were changed or not signed by the coordinator"
                             ) from None
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise RunSpecRefused("the certificate that signed the run spec is not valid now")


def describe(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings an operator reviews before joining (a flat, display-ready dict)."""
    spec = dict(settings.get("spec", {}))
    keys = ("method", "personalization", "task", "rounds", "epochs", "batch_size", "lr", "selector_lr",
            "image_size", "seed", "lam", "gamma", "prox_mu", "extra_rounds", "selector_size", "selector_head",
            "selector_width", "site_names")
    shown = {k: spec[k] for k in keys if k in spec}
    return {**shown, "app_hash": settings.get("app_hash"), "session": settings.get("session"),
            "signed": bool(settings.get("signed"))}


def format_settings(shown: Mapping[str, Any]) -> str:
    """:func:`describe`'s dict as one readable line."""
    order = (("method", "{}"), ("personalization", "personalization {}"),
             ("task", "task {}"), ("rounds", "{} rounds"), ("epochs", "{} epoch(s) per round"),
             ("batch_size", "batch {}"), ("lr", "lr {:g}"), ("selector_lr", "selector lr {:g}"),
             ("image_size", "{} px"), ("seed", "seed {}"), ("lam", "lam {:g}"), ("gamma", "gamma {:g}"))
    parts = []
    for key, pattern in order:
        value = shown.get(key)
        if value is not None:
            try:
                parts.append(pattern.format(value))
            except (TypeError, ValueError):
                parts.append(f"{key} {value}")
    sites = shown.get("site_names")
    if isinstance(sites, list | tuple):
        parts.append("sites " + ", ".join(map(str, sites)))
    origin = "signed by the coordinator" if shown.get("signed") else "NOT signed (insecure mode)"
    return f"run settings ({origin}, within this site's bounds): " + "; ".join(parts) + \
        f"; app {str(shown.get('app_hash', '?'))[:19]}…"


def bounds_dict(bounds: SiteBounds) -> dict[str, Any]:
    """``bounds`` as JSON-ready data (passed to the SuperNode's launcher)."""
    out = asdict(bounds)
    for key in ("allowed_methods", "allowed_personalizations"):
        if out[key] is None:
            del out[key]  # the default: every method / rule
        else:
            out[key] = list(out[key])
    return out
