"""Start-up checks of ``fedsm server`` and ``fedsm site``: one clear line per problem, before anything starts.

Without them a busy port surfaced as a 60-line httpx traceback (the cause only in superlink.log), a
broken datalist as tracebacks and retries in round 1, and a damaged certificate deep inside TLS.
Each check raises :class:`engine.errors.ConfigError` (or :class:`DataError` for the site's data)
whose message names the file or address and what to do; the CLI prints it as one line.

- :func:`check_port_free`: nothing else listens on an address this process must bind.
- :func:`check_site_certificates`: the site's CA certificate parses, is a CA and is valid now; its
  private key parses.
- :func:`check_site_datalist`: the datalist follows the specification, is for the site's task, has
  training entries, and every file it names exists.
- :func:`round_banner`: "3 rounds (+1 validation and calibration round)": the count a person asked for.
"""

from __future__ import annotations

import datetime as dt
import errno
import os
import socket
import time
from pathlib import Path
from typing import Any

from cryptography import x509

from engine.data.datalist import load_datalist_with_info
from engine.errors import ConfigError, DataError
from engine.federation.config import parse_address
from engine.security.certs import load_site_private_key


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_port_free(host: str, port: int, what: str, where: str) -> None:
    """Raise :class:`ConfigError` when ``host:port`` cannot be bound because something else uses it.

    Parameters
    ----------
    host, port
        The address to be listened on (``0.0.0.0`` / ``::`` for every interface).
    what
        What listens there, for the message ("the coordinator's Fleet address").
    where
        Where the address is configured, for the message ("federation.toml [federation] address").
    """
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host if host not in ("", "localhost") else "127.0.0.1"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # the same flag the servers set: a port left in TIME_WAIT by an earlier run is not "busy"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                reason = "is in use by another program" if exc.errno == errno.EADDRINUSE else "needs privileges"
                raise ConfigError(f"{what} {host}:{port} {reason}; stop that program (or the earlier FedSM run) or "
                                  f"choose another port in {where}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{what} {host}:{port} is not an address of this machine; use one of its own "
                                  f"addresses (or 0.0.0.0) in {where}") from None
            raise ConfigError(f"{what} {host}:{port} cannot be opened ({exc.strerror}); fix {where}") from None


def check_site_certificates(ca_cert: Path | None, private_key: Path | None, where: str) -> None:
    """Raise :class:`ConfigError` unless the site's CA certificate and private key are usable.

    The CA certificate must be a PEM X.509 certificate of a certificate authority, valid now; the
    private key a PEM key FedSM can use (see :func:`engine.security.certs.load_site_private_key`).
    """
    if ca_cert is not None:
        try:
            cert = x509.load_pem_x509_certificate(Path(ca_cert).read_bytes())
        except FileNotFoundError:
            raise ConfigError(f"{where} [security] ca_cert {ca_cert} does not exist; copy the federation's ca.pem "
                              "from the coordinator") from None
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{where} [security] ca_cert {ca_cert} is not a PEM certificate ({exc}); copy the "
                              "federation's ca.pem from the coordinator again") from None
        try:
            is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise ConfigError(f"{where} [security] ca_cert {ca_cert} is not a certificate authority (it is a leaf "
                              "certificate); use the federation's ca.pem, not the coordinator's server.pem")
        now = dt.datetime.now(dt.UTC)
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise ConfigError(f"{where} [security] ca_cert {ca_cert} is valid from "
                              f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d}, not "
                              "now; ask the coordinator for the federation's current ca.pem")
    if private_key is not None:
        try:
            load_site_private_key(Path(private_key))
        except ConfigError as exc:
            raise ConfigError(f"{where} [security] private_key: {exc}") from None


def check_site_datalist(datalist: Path, task: str, where: str) -> dict[str, int]:
    """Check the site's datalist before joining; return entries per section.

    Raises
    ------
    DataError
        When it breaks the specification, is for another task, has no training entries, or names
        files that do not exist (the first few are listed).
    """
    try:
        sections, info = load_datalist_with_info(datalist)
    except DataError as exc:
        raise DataError(f"{where} [site] datalist: {exc}") from None
    stated = info.get("task")
    if isinstance(stated, str) and stated != task:
        raise DataError(f"{where} [site] datalist {datalist} is for task {stated!r}, but the site joins as {task!r}; "
                        "point [site] datalist at this task's datalist or fix [site] task")
    if not sections.get("training"):
        raise DataError(f"{where} [site] datalist {datalist} has no training entries; build it with 'fedsm "
                        "datalist' (see docs/io.md)")
    missing = [str(e[k]) for entries in sections.values() for e in entries for k in ("image", "label")
               if not os.path.exists(e[k])]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise DataError(f"{where} [site] datalist {datalist} names {len(missing)} missing file(s): "
                        f"{', '.join(missing[:3])}{more}; fix the paths (relative to the datalist's folder) and run "
                        "'fedsm validate-data' on it")
    return {k: len(v) for k, v in sections.items()}


def round_banner(method: Any) -> str:
    """The rounds a run trains, with extra phases named: ``"3 rounds (+1 validation and calibration round)"``.

    FedSM's last round trains nothing: each site measures the global and its personalized model
    on its validation data (the routing guard's evidence) and, with a calibration scheme, sends
    the selector's calibration statistics.
    """
    rounds = int(getattr(method, "rounds", method.total_rounds))
    extra = int(method.total_rounds) - rounds
    text = f"{rounds} round{'s' if rounds != 1 else ''}"
    if extra <= 0:
        return text
    selector = int(getattr(method, "extra_rounds", 0) or 0)
    warmup = int(getattr(method, "selector_warmup", 0) or 0)
    parts = []
    if warmup:
        parts.append(f"+{warmup} selector warm-up round{'s' if warmup != 1 else ''}")
        extra -= warmup
    if selector:
        parts.append(f"+{selector} selector round{'s' if selector != 1 else ''}")
    if extra - selector > 0:
        parts.append(f"+{extra - selector} validation and calibration round{'s' if extra - selector != 1 else ''}")
    return f"{text} ({', '.join(parts)})"


class CoordinatorWatch:
    """Tells a ``--once`` site that its coordinator is gone: seen listening once, then refusing for ``grace`` s.

    A site started before its coordinator waits for it as long as it takes; only a coordinator
    that was there and then stopped accepting connections for ``grace`` seconds counts as gone.
    Probes are plain TCP connects, at most one per ``interval`` seconds.
    """

    def __init__(self, address: str, where: str, grace: float = 30.0, interval: float = 2.0) -> None:
        self.host, self.port = parse_address(address, where)
        self.grace = float(grace)
        self.interval = float(interval)
        self.seen = False
        self._last_probe = float("-inf")
        self._down_since: float | None = None

    def gone(self, now: float | None = None) -> bool:
        """Probe (rate-limited) and say whether the coordinator has been gone for ``grace`` seconds."""
        now = time.monotonic() if now is None else now
        if now - self._last_probe < self.interval:
            return self._down_since is not None and now - self._down_since >= self.grace
        self._last_probe = now
        if port_open(self.host, self.port, timeout=1.0):
            self.seen = True
            self._down_since = None
            return False
        if not self.seen:
            return False
        if self._down_since is None:
            self._down_since = now
        return now - self._down_since >= self.grace
