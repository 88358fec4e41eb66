"""The signed run spec: the coordinator signs the run's settings; a site checks them against its own bounds.

App approval pins the code a site runs; the run's settings (method, hyper-parameters, rounds,
image size) decide what that code does with the site's data. The coordinator puts them, with
the app's hash, the run's session, a run id (:func:`new_run_id`, drawn each time it starts or
resumes a run) and the times it issued the envelope and until which a site may first accept it,
into an envelope signed with its TLS key (the key the federation CA certified for the
coordinator; ECDSA P-384 with SHA-384) and attaches its certificate. The envelope travels as the
run's configuration (Flower's ``override_config``, key :data:`RUN_CONFIG_KEY`), which a site's
SuperNode reads before it pulls any message payload; every message of the run carries the run
id too.

A site (:func:`verify_envelope`) checks that the certificate was issued by its federation CA
(``[security] ca_cert``) and is valid now, that the signature covers exactly these settings,
that the signed app hash is the app being run, that the settings stay within the hard bounds
declared beside each setting and the ``[bounds]`` of its ``site.toml`` (:class:`SiteBounds`),
and, when it first sees the run, that the envelope has not expired; it then records the run id
with the Flower run (:class:`RunLedger`) and refuses the same envelope in any other run.
Anything else is refused before a byte of the payload is pulled, and every message's own copy
of the settings and run id must equal the signed ones. In ``--insecure`` demonstrations there
are no certificates: the envelope is not signed, and everything else is still checked.
"""

from __future__ import annotations

import base64
import datetime as dt
import difflib
import json
import math
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from engine.errors import ConfigError, FedSMError
from engine.fl.registry import all_option_bounds, all_option_totals
from engine.io.atomic import write_text_atomic

ENVELOPE_FORMAT = "fedsm-signed-run-spec/2"
#: Formats of older coordinators: refused with a message that says what to update.
OLD_ENVELOPE_FORMATS = ("fedsm-signed-run-spec/1",)
#: Key of the run configuration that carries the envelope (declared in the FAB's pyproject).
RUN_CONFIG_KEY = "fedsm_run_spec"
_DOMAIN = b"fedsm run spec v2\n"
#: Start of the SuperNode's output line that tells the site process it refused a run's settings.
REFUSED_SPEC = "FEDSM-REFUSED-SPEC"
#: Lifetime of a signed spec when the coordinator gives none: a site first accepts the run within it.
DEFAULT_LIFETIME_S = 24 * 3600
#: Longest lifetime a site accepts: a spec signed for longer is refused (whatever its age).
MAX_LIFETIME_S = 30 * 24 * 3600
#: How far ahead of a site's clock a coordinator's may be.
CLOCK_SKEW_S = 300
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class RunSpecRefused(FedSMError):
    """A run's settings are unsigned, badly signed, expired, replayed, or outside this site's bounds."""


def new_run_id() -> str:
    """A fresh run id (128 random bits, hex): the coordinator draws one each time it starts (or resumes) a run."""
    return secrets.token_hex(16)


@dataclass(frozen=True)
class SiteBounds:
    """The ``[bounds]`` table of ``site.toml``: what this site agrees to run (every key optional).

    The fields are the historical keys, with this site's defaults tighter than the hard bounds;
    every other key is generated from the settings' declarations (:func:`engine.fl.method_spec.site_keys`:
    ``max_<setting>``, ``min_<setting>``, ``allowed_<setting>s``; docs/federation.md lists them) and
    kept in :attr:`more`. A key left out leaves that setting at its hard bounds (or the default below).
    """

    #: ``None``: every method this installation can run over the network
    allowed_methods: tuple[str, ...] | None = None
    #: rounds the sites train in all (FedSM's warm-up, FedSM-extra's selector rounds included)
    max_rounds: int = 1000
    #: passes over the site's data any network trains per round (selector, BlackFed phases too)
    max_epochs: int = 20
    #: learning rate of the U-Nets (and BlackFed's SPSA step size)
    max_lr: float = 0.01
    max_selector_lr: float = 0.01
    max_image_size: int = 1024
    max_batch_size: int = 256
    min_batch_size: int = 1
    #: FedSM personalization rules this site agrees to train (``None``: all). A rule decides what
    #: the site keeps and what it sends (docs/federation.md, "What leaves a site").
    allowed_personalizations: tuple[str, ...] | None = None
    #: every other key this site wrote, as ``(key, value)`` pairs (lists as tuples)
    more: tuple[tuple[str, Any], ...] = ()

    def limit(self, key: str) -> Any:
        """This site's value of ``[bounds]`` key ``key`` (``None``: not tightened)."""
        if key in _FIELDS:
            return getattr(self, key)
        return dict(self.more).get(key)

    @classmethod
    def from_dict(cls, table: Mapping[str, Any] | None, where: str = "[bounds]") -> SiteBounds:
        from engine.fl.method_spec import site_keys

        table = dict(table or {})
        known = site_keys()
        unknown = sorted(set(table) - set(known))
        if unknown:
            hints = [f"{k} (did you mean {', '.join(close)}?)" if (close := difflib.get_close_matches(k, known, 3))
                     else k for k in unknown]
            raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; a key is max_<setting>, min_<setting> or "
                              "allowed_<setting>s of a run setting; docs/federation.md ([bounds]) lists all "
                              f"{len(known)}")
        legacy: dict[str, Any] = {}
        more: list[tuple[str, Any]] = []
        for key in sorted(table):
            value = _site_value(known[key], table[key], where)
            if key in _FIELDS:
                legacy[key] = value
            else:
                more.append((key, value))
        return cls(**legacy, more=tuple(more))

    def violations(self, spec: Mapping[str, Any]) -> list[str]:
        """What in the run's settings ``spec`` (a MethodSpec as a dict) breaks the declared bounds or these.

        Every setting is checked against the hard bounds declared beside it and against this site's
        keys (:func:`engine.fl.method_spec.settings_problems`); no torch is imported.
        """
        from engine.fl.method_spec import settings_problems

        return settings_problems(spec, self.limit)


_FIELDS = tuple(f.name for f in fields(SiteBounds) if f.name != "more")


def _site_value(key: Any, value: Any, where: str) -> Any:
    """A site's ``[bounds]`` value for ``key`` (a :class:`engine.fl.method_spec.SiteKey`), checked."""
    bound, name = key.bound, key.key
    settings = ", ".join(key.settings)
    if key.direction == "allowed":
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {name} must be a list, e.g. {name} = [...] (values of {settings})")
        static = not callable(bound.choices)
        for item in value:
            problem = bound.problem(key.settings[0], item) if static else (
                None if isinstance(item, str) else f"{item!r} is not a name")
            if problem is not None:
                raise ConfigError(f"{where}: {name} lists {item!r}: {problem}")
        return tuple(value)
    integral = bound.kind in ("int", "names")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or (integral and not isinstance(value, int)):
        raise ConfigError(f"{where}: {name} = {value!r} must be {'an integer' if integral else 'a number'} "
                          f"({settings}: {bound.describe()})")
    low = 1 if bound.kind == "names" else bound.low
    if key.direction == "max" and low is not None and (value < low or (bound.low_open and value == low)):
        raise ConfigError(f"{where}: {name} = {value!r} would refuse every run ({settings}: {bound.describe()}); "
                          "raise it or leave it out")
    if key.direction == "min" and bound.high is not None and (value > bound.high or (bound.high_open and
                                                                                       value == bound.high)):
        raise ConfigError(f"{where}: {name} = {value!r} would refuse every run ({settings}: {bound.describe()}); "
                          "lower it or leave it out")
    return value


def _message(envelope: Mapping[str, Any]) -> bytes:
    signed = {k: envelope[k] for k in ("spec", "app_hash", "session", "run_id", "issued_at", "expires_at")}
    return _DOMAIN + json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()


def make_envelope(spec_json: str, app_hash: str, session: str, key_path: Path | None = None,
                  cert_path: Path | None = None, *, run_id: str | None = None,
                  lifetime_s: float = DEFAULT_LIFETIME_S, now: float | None = None) -> str:
    """The run's settings as an envelope; signed with the coordinator's key when ``key_path`` is given.

    Parameters
    ----------
    run_id
        This start of the run (:func:`new_run_id`; drawn here when not given): every message of
        the run carries it, and a site that accepted it for one Flower run refuses it for another.
    lifetime_s
        Seconds from now within which a site may first accept the run (at most
        :data:`MAX_LIFETIME_S`); a long run continues past it.
    """
    if not 0 < lifetime_s <= MAX_LIFETIME_S:
        raise ConfigError(f"the run spec's lifetime must lie in (0, {MAX_LIFETIME_S}] seconds, got {lifetime_s}")
    issued = int(time.time() if now is None else now)
    envelope: dict[str, Any] = {"format": ENVELOPE_FORMAT, "spec": spec_json, "app_hash": app_hash,
                                "session": session, "run_id": run_id or new_run_id(), "issued_at": issued,
                                "expires_at": issued + math.ceil(lifetime_s), "signature": None,
                                "certificate": None}
    if key_path is not None and cert_path is not None:
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key_path} is not the coordinator's EC private key")
        signature = key.sign(_message(envelope), ec.ECDSA(hashes.SHA384()))
        envelope["signature"] = base64.b64encode(signature).decode()
        envelope["certificate"] = Path(cert_path).read_text()
    return json.dumps(envelope, sort_keys=True)


def verify_envelope(envelope_json: object, *, ca_cert: Path | None, app_hash: str | None,
                    bounds: SiteBounds, flower_run: int | None = None, ledger: RunLedger | None = None,
                    now: float | None = None) -> dict[str, Any]:
    """Check a run's envelope at a site; return the settings (a dict) or raise :class:`RunSpecRefused`.

    Parameters
    ----------
    ca_cert
        The site's federation CA certificate; ``None`` (insecure mode only) skips the signature.
    app_hash
        The hash of the app bundle being run (``None``: not checked).
    flower_run, ledger
        The Flower run the envelope came with, and the site's record of the runs it accepted
        (:class:`RunLedger`). The first time a run id is seen the envelope must not have
        expired, and it is recorded for this Flower run; later (a long run, a restarted
        SuperNode) it is accepted whatever its age, for that Flower run only: the same signed
        spec in another run is a replay and refused. Without them every call checks the expiry.
    now
        The time (seconds since the epoch) to check the expiry against; default: now.
    """
    try:
        envelope = json.loads(envelope_json) if isinstance(envelope_json, str) else None
    except ValueError:
        envelope = None
    if isinstance(envelope, dict) and envelope.get("format") in OLD_ENVELOPE_FORMATS:
        raise RunSpecRefused(f"the coordinator signed this run's settings in the old format {envelope['format']}, "
                             "which carries no run id and no expiry (such a signed spec could be replayed for "
                             f"another run); refusing it. Update FedSM at the coordinator (this site reads "
                             f"{ENVELOPE_FORMAT})")
    if not isinstance(envelope, dict) or envelope.get("format") != ENVELOPE_FORMAT:
        raise RunSpecRefused("the run carries no readable run spec from the coordinator; refusing it")
    spec_json, signed_app, session = envelope.get("spec"), envelope.get("app_hash"), envelope.get("session")
    run_id, issued, expires = envelope.get("run_id"), envelope.get("issued_at"), envelope.get("expires_at")
    if not all(isinstance(v, str) for v in (spec_json, signed_app, session, run_id)) \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in (issued, expires)):
        raise RunSpecRefused("the run spec is incomplete (settings, app, session, run id, issue and expiry "
                             "times); refusing the run")
    if not _RUN_ID.match(str(run_id)):
        raise RunSpecRefused(f"the run spec's run id {str(run_id)[:40]!r} is not 32 hex digits; refusing the run")
    if ca_cert is not None:  # a secure site: only the coordinator's signature is accepted
        _check_signature(envelope, ca_cert, _message(envelope))
    if app_hash is not None and signed_app != app_hash:
        raise RunSpecRefused(f"the run spec was signed for app {signed_app}, but the run is of app {app_hash}")
    if not 0 < expires - issued <= MAX_LIFETIME_S:  # type: ignore[operator]
        raise RunSpecRefused(f"the run spec is valid for {expires - issued} s (issued {_utc(issued)}, expires "  # type: ignore[operator]
                             f"{_utc(expires)}); a site accepts at most {MAX_LIFETIME_S // 86400} days: the "
                             "coordinator must sign it with a shorter [federation] run_spec_lifetime")
    try:
        spec = json.loads(spec_json)  # type: ignore[arg-type]
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise RunSpecRefused("the run spec's settings are not readable")
    broken = bounds.violations(spec)
    if broken:
        raise RunSpecRefused("the run's settings break this site's [bounds] in site.toml: " + "; ".join(broken))
    first = _accept_run(str(run_id), issued, expires, flower_run, ledger,  # type: ignore[arg-type]
                        time.time() if now is None else now)
    return {"spec": spec, "spec_json": spec_json, "app_hash": signed_app, "session": session, "run_id": run_id,
            "issued_at": issued, "expires_at": expires, "first": first,
            "signed": envelope.get("signature") is not None}


def _accept_run(run_id: str, issued: int, expires: int, flower_run: int | None, ledger: RunLedger | None,
                now: float) -> bool:
    """Tie ``run_id`` to ``flower_run`` in ``ledger``; on first sight check the expiry. Whether it was first."""
    earlier = None if ledger is None else ledger.flower_run(run_id)
    if earlier is not None and flower_run is not None and earlier != flower_run:
        raise RunSpecRefused(f"this signed run spec (run id {run_id[:12]}…) was already accepted by this site for "
                             f"Flower run {earlier}, and now comes with run {flower_run}: it is replayed, not "
                             "signed for this run; refusing it (a coordinator signs a new spec each time it starts "
                             "or resumes a run)")
    if earlier is not None:
        return False
    if now > expires:
        raise RunSpecRefused(f"the run spec expired at {_utc(expires)} (issued {_utc(issued)}); a site accepts a "
                             "run first within its signed lifetime. Restart the run at the coordinator (it signs "
                             "a fresh spec), or raise [federation] run_spec_lifetime there if sites join late")
    if issued > now + CLOCK_SKEW_S:
        raise RunSpecRefused(f"the run spec was issued at {_utc(issued)}, ahead of this site's clock "
                             f"({_utc(int(now))}); set both clocks right (NTP) and restart the run")
    if ledger is not None and flower_run is not None:
        ledger.record(run_id, flower_run, expires, now)
    return True


def _utc(seconds: int) -> str:
    try:
        return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (ValueError, OverflowError, OSError):  # a hostile envelope's time: shown as given
        return f"{seconds} s after 1970"


class RunLedger:
    """The runs a site accepted: run id (from the signed spec) -> Flower run, kept in one JSON file.

    The SuperNode records a run when it first accepts it; the site process reads the same file,
    so a run accepted once stays accepted for its Flower run after a restart, and the same
    signed spec in another Flower run is refused. Entries older than :data:`MAX_LIFETIME_S`
    beyond their expiry, and all but the newest :attr:`KEEP`, are dropped on each write.
    """

    FORMAT = "fedsm-accepted-runs/1"
    KEEP = 1000

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        runs = data.get("runs") if isinstance(data, dict) and data.get("format") == self.FORMAT else None
        return {k: v for k, v in runs.items() if isinstance(v, dict)} if isinstance(runs, dict) else {}

    def flower_run(self, run_id: str) -> int | None:
        """The Flower run ``run_id`` was accepted for (``None``: never accepted here)."""
        entry = self._read().get(run_id)
        value = None if entry is None else entry.get("flower_run")
        return value if isinstance(value, int) else None

    def record(self, run_id: str, flower_run: int, expires: int, now: float | None = None) -> None:
        at = time.time() if now is None else now
        runs = self._read()
        runs[run_id] = {"flower_run": int(flower_run), "expires_at": int(expires), "accepted_at": int(at)}
        kept = sorted(((k, v) for k, v in runs.items()
                       if int(v.get("expires_at", 0)) + MAX_LIFETIME_S >= at),
                      key=lambda kv: int(kv[1].get("accepted_at", 0)))[-self.KEEP:]
        write_text_atomic(self.path, json.dumps({"format": self.FORMAT, "runs": dict(kept)}, sort_keys=True))


def _check_signature(envelope: Mapping[str, Any], ca_cert: Path, message: bytes) -> None:
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
            "run_id": settings.get("run_id"), "expires_at": settings.get("expires_at"),
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


def bounds_table() -> str:
    """Every signed setting, its hard bound and the ``[bounds]`` keys that tighten it, as a markdown table.

    Generated from the settings' declarations; docs/federation.md holds it (tests/federation/
    test_setting_bounds.py keeps the two equal).
    """
    from engine.fl.method_spec import TOTALS, field_bounds

    defaults = {f.name: f.default for f in fields(SiteBounds) if f.name in _FIELDS}

    def key(name: str) -> str:
        default = defaults.get(name)
        shown = "" if default is None else f" ({default:g})" if isinstance(default, float) else f" ({default})"
        return f"`{name}`{shown}"

    lines = ["| setting | hard bound | tightened by (default when left out) |", "|---|---|---|"]
    for name, bound in {**field_bounds(), **all_option_bounds()}.items():
        keys = ", ".join(key(k) for k in (*bound.site_keys(name), *bound.limited_by))
        lines.append(f"| `{name}`: {bound.help} | {bound.describe()} | {keys} |")
    for total in (*TOTALS, *all_option_totals()):
        lines.append(f"| {total.name} ({total.formula}) | at most {total.high:g} | {key(total.site_key)} |")
    return "\n".join(lines) + "\n"


def bounds_dict(bounds: SiteBounds) -> dict[str, Any]:
    """``bounds`` as JSON-ready data (passed to the SuperNode's launcher)."""
    out = asdict(bounds)
    more = out.pop("more")
    for key in ("allowed_methods", "allowed_personalizations"):
        if out[key] is None:
            del out[key]  # the default: every method / rule
        else:
            out[key] = list(out[key])
    for key, value in more:
        out[key] = list(value) if isinstance(value, tuple) else value
    return out
