"""``federation.toml`` (the coordinator) and ``site.toml`` (one site): parsing and checks.

Relative paths in either file are relative to the folder that holds the file. Every mistake
is a :class:`engine.errors.ConfigError` naming the file, the key and what to write instead.

``federation.toml``::

    [federation]
    sites = ["site1", "site2", "site3"]  # order = the selector's label order
    address = "127.0.0.1:9092"           # where sites connect (the Fleet API alone)
    work_dir = "coordinator"             # checkpoints, events, results, Flower state
    min_sites = 2                        # a round needs this many answers
    round_timeout = 600                  # seconds a round waits for answers
    start_timeout = 600                  # seconds to wait for sites before round 1
    round_attempts = 3                   # tries of a round that got fewer than min_sites answers
    rejoin_wait = 0                      # seconds a round waits for disconnected sites to come back
    poll_interval = 0.2                  # seconds between checks for answers
    superlink_port = 0                   # loopback port of the SuperLink (0 = any free port)
    keep_checkpoints = 3                 # checkpoints kept (a corrupt newest one falls back to the one before)
    run_spec_lifetime = 0                # seconds within which a site first accepts the signed run (0 = the
                                         # run's longest duration from the timeouts; at most 30 days)

    [robust]                             # bounds on sites' updates: engine.fl.robust.RobustSettings

    [tls]                                # defaults: <work_dir>/certs/{ca.pem,server.pem,server.key}
    ca_cert = "certs/ca.pem"
    server_cert = "certs/server.pem"
    server_key = "certs/server.key"

    [training]                           # see engine.federation.spec.MethodSpec
    task = "fundus"
    method = "fedsm"
    rounds = 3
    seed = 0
    image_size = 256

``site.toml``::

    [site]
    name = "site1"                       # as enrolled at the coordinator
    coordinator = "coordinator.example.org:9092"
    datalist = "data/datalist.json"
    task = "fundus"
    work_dir = "site1-work"
    device = "auto"                      # auto | cpu | cuda
    threads = 0                          # torch CPU threads (0 = the free cores, or OMP_NUM_THREADS)
    poll_interval = 0.2
    runtime_port = 0                     # loopback port of the local SuperNode (0 = any free port)

    [security]
    ca_cert = "certs/ca.pem"
    private_key = "certs/site1.key"
    approved_apps = ["sha256:..."]       # app hashes this site runs (`fedsm certs app-hash`)

    [bounds]                             # settings this site agrees to run: engine.security.run_spec.SiteBounds
    allowed_methods = ["fedsm"]
    max_epochs = 2

    [privacy]                            # optional; FedIOD's noised input gradients (engine.fl.fediod_privacy)
    noise_multiplier = 1.0               # sigma, noise std in units of clip_norm (0 = no DP) ...
    # epsilon = 8.0                      # ... or an epsilon target for the run (not both)
    clip_norm = 1.0                      # L2 bound of one release
    delta = 1e-5
"""

from __future__ import annotations

import ipaddress
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.bundle import check_site_name
from engine.errors import ConfigError
from engine.federation.spec import MethodSpec
from engine.fl.fediod_privacy import DEFAULT_DELTA, PrivacySetting
from engine.io.masks import MAX_TOLERATED_DEG
from engine.security.approval import normalise_app_hash
from engine.security.run_spec import MAX_LIFETIME_S, SiteBounds
from engine.tasks import get_task

DEFAULT_ADDRESS = "127.0.0.1:9092"

_FEDERATION_KEYS = {"sites", "address", "work_dir", "min_sites", "round_timeout", "start_timeout",
                    "round_attempts", "poll_interval", "superlink_port", "name", "rejoin_wait",
                    "keep_checkpoints", "run_spec_lifetime"}
_TLS_KEYS = {"ca_cert", "server_cert", "server_key"}
_SITE_KEYS = {"name", "coordinator", "datalist", "task", "work_dir", "device", "threads", "poll_interval",
              "runtime_port", "share_activations", "allow_outside", "tolerate_orientation"}
_SECURITY_KEYS = {"ca_cert", "private_key", "approved_apps"}
_PRIVACY_KEYS = {"noise_multiplier", "epsilon", "clip_norm", "delta"}


def _read_toml(path: Path, kind: str) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{kind} file {path} does not exist; see docs/federation.md for an example") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder; give the path of the {kind} file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def _table(doc: dict[str, Any], name: str, path: Path, allowed: set[str] | None, required: bool = True
           ) -> dict[str, Any]:
    table = doc.get(name)
    if table is None:
        if required:
            raise ConfigError(f"{path}: missing [{name}] table; see docs/federation.md")
        return {}
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {name} must be a table ([{name}]), not a value")
    if allowed is not None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {unknown} in [{name}]; allowed: {sorted(allowed)}")
    return table


def _get(table: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = None,
         required: bool = False) -> Any:
    if key not in table:
        if required:
            raise ConfigError(f"{where}: missing key {key!r}")
        return default
    value = table[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"{where}: {key} = {value!r} must be a {names}")
    return value


def _positive(value: float, key: str, where: str, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}: {key} = {value} must be {'>= 0' if allow_zero else '> 0'}")
    return value


def _port(value: int, key: str, where: str) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{where}: {key} = {value} is not a TCP port (0..65535)")
    return value


def parse_address(text: str, where: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[::1]:9092``) -> ``(host, port)``; :class:`ConfigError` otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ConfigError(f"{where}: address {text!r} must be host:port, e.g. 127.0.0.1:9092")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} in {text!r} is not in 1..65535")
    return host, port


def is_loopback(host: str) -> bool:
    """Whether ``host`` names the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TLSFiles:
    """The coordinator's CA certificate and its own certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class FederationConfig:
    """A parsed ``federation.toml``."""

    path: Path
    spec: MethodSpec
    host: str
    port: int
    work_dir: Path
    tls: TLSFiles
    min_sites: int = 1
    round_timeout: float = 600.0
    start_timeout: float = 600.0
    round_attempts: int = 3
    poll_interval: float = 0.2
    superlink_port: int = 0
    name: str = "fedsm"
    rejoin_wait: float = 0.0
    keep_checkpoints: int = 3
    #: the ``[robust]`` table as written (checked by :func:`engine.fl.robust.RobustSettings.from_dict`)
    robust: dict[str, Any] = field(default_factory=dict)
    #: seconds within which a site may first accept the signed run spec (0: :attr:`spec_lifetime` computes it)
    run_spec_lifetime: float = 0.0

    @property
    def sites(self) -> tuple[str, ...]:
        return self.spec.site_names

    @property
    def spec_lifetime(self) -> float:
        """Seconds the signed run spec stays valid for a site's first acceptance of the run.

        ``run_spec_lifetime`` when set; else the longest the run can take by its own timeouts (the
        wait for sites, then every round tried ``round_attempts`` times, each waiting
        ``round_timeout`` and ``rejoin_wait``), so a site that joins late is still accepted; at
        most :data:`engine.security.run_spec.MAX_LIFETIME_S`. A run lasts as long as it needs: the
        lifetime only bounds when a site first accepts it.
        """
        if self.run_spec_lifetime:
            return self.run_spec_lifetime
        longest = self.start_timeout + self.spec.total_rounds * self.round_attempts * (self.round_timeout +
                                                                                        self.rejoin_wait)
        return min(max(longest, 3600.0), MAX_LIFETIME_S)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def enrolled_dir(self) -> Path:
        """Where enrolled site public keys are kept."""
        return self.work_dir / "enrolled"


def load_federation_config(path: Path) -> FederationConfig:
    """Read and check ``federation.toml``."""
    path = Path(path).absolute()
    doc = _read_toml(path, "federation")
    unknown = sorted(set(doc) - {"federation", "tls", "training", "robust"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {unknown}; use [federation], [tls], [training] and [robust]")
    fed = _table(doc, "federation", path, _FEDERATION_KEYS)
    where = f"{path} [federation]"
    sites = _get(fed, "sites", list, where, required=True)
    if not all(isinstance(s, str) for s in sites):
        raise ConfigError(f"{where}: sites must be a list of site names, e.g. [\"site1\", \"site2\"]")
    host, port = parse_address(_get(fed, "address", str, where, DEFAULT_ADDRESS), where)
    base = path.parent
    work_dir = base / _get(fed, "work_dir", str, where, "coordinator")
    min_sites = _get(fed, "min_sites", int, where, 1)
    if not 1 <= min_sites <= len(sites):
        raise ConfigError(f"{where}: min_sites = {min_sites} must lie between 1 and the number of sites "
                          f"({len(sites)})")
    round_attempts = _get(fed, "round_attempts", int, where, 3)
    if round_attempts < 1:
        raise ConfigError(f"{where}: round_attempts = {round_attempts} must be >= 1")
    tls = _table(doc, "tls", path, _TLS_KEYS, required=False)
    tls_where = f"{path} [tls]"
    tls_files = TLSFiles(
        base / _get(tls, "ca_cert", str, tls_where, str(work_dir / "certs" / "ca.pem")),
        base / _get(tls, "server_cert", str, tls_where, str(work_dir / "certs" / "server.pem")),
        base / _get(tls, "server_key", str, tls_where, str(work_dir / "certs" / "server.key")),
    )
    keep_checkpoints = _get(fed, "keep_checkpoints", int, where, 3)
    if keep_checkpoints < 1:
        raise ConfigError(f"{where}: keep_checkpoints = {keep_checkpoints} must be >= 1")
    robust = _table(doc, "robust", path, None, required=False)
    from engine.fl.robust import RobustSettings

    RobustSettings.from_dict(robust, f"{path} [robust]")  # checked now, not at the first round
    training = _table(doc, "training", path, None)
    try:
        spec = MethodSpec.from_dict({**training, "site_names": tuple(sites)})
    except ConfigError as exc:
        raise ConfigError(f"{path} [training]: {exc}") from None
    superlink_port = _port(_get(fed, "superlink_port", int, where, 0), "superlink_port", where)
    if superlink_port and superlink_port == port:
        raise ConfigError(f"{where}: superlink_port = {superlink_port} is the port of address; the SuperLink's "
                          "loopback port and the sites' port must differ (0: any free port)")
    return FederationConfig(
        path=path, spec=spec, host=host, port=port, work_dir=work_dir, tls=tls_files,
        min_sites=min_sites,
        round_timeout=_positive(float(_get(fed, "round_timeout", (int, float), where, 600.0)), "round_timeout", where),
        start_timeout=_positive(float(_get(fed, "start_timeout", (int, float), where, 600.0)), "start_timeout", where),
        round_attempts=round_attempts,
        poll_interval=_positive(float(_get(fed, "poll_interval", (int, float), where, 0.2)), "poll_interval", where),
        superlink_port=superlink_port,
        name=_get(fed, "name", str, where, "fedsm"),
        rejoin_wait=_positive(float(_get(fed, "rejoin_wait", (int, float), where, 0.0)), "rejoin_wait", where,
                              allow_zero=True),
        keep_checkpoints=keep_checkpoints, robust=dict(robust),
        run_spec_lifetime=_lifetime(_get(fed, "run_spec_lifetime", (int, float), where, 0), where),
    )


def _lifetime(value: float, where: str) -> float:
    if isinstance(value, bool) or not math.isfinite(value) or not 0 <= value <= MAX_LIFETIME_S:
        raise ConfigError(f"{where}: run_spec_lifetime = {value!r} must be a number of seconds in [0, "
                          f"{MAX_LIFETIME_S}] (0: the run's longest duration by its timeouts)")
    return float(value)


@dataclass(frozen=True)
class SiteConfig:
    """A parsed ``site.toml``."""

    path: Path
    name: str
    coordinator: str
    datalist: Path
    task: str
    work_dir: Path
    ca_cert: Path | None
    private_key: Path | None
    approved_apps: tuple[str, ...] = field(default_factory=tuple)
    device: str = "auto"
    threads: int = 0
    poll_interval: float = 0.2
    runtime_port: int = 0
    #: The operator agreed that split-learning methods (BlackFed) may send activations of this
    #: site's images and their masks to the coordinator ([site] share_activations = true).
    share_activations: bool = False
    #: The site's datalist may name files outside its own folder ([site] allow_outside = true; the
    #: CLI's ``--allow-outside``). Off by default: a datalist cannot make the site read other files.
    allow_outside: bool = False
    #: Masks on the image's voxel grid whose orientation header differs by up to this many degrees
    #: are accepted ([site] tolerate_orientation; the CLI's ``--tolerate-orientation``).
    tolerate_orientation: float = 0.0
    #: the ``[bounds]`` table as written (checked by :meth:`engine.security.run_spec.SiteBounds.from_dict`)
    bounds: dict[str, Any] = field(default_factory=dict)
    #: The operator's privacy setting (``[privacy]``); ``None`` = none given (no noise).
    privacy: PrivacySetting | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for display (paths as strings)."""
        return {
            "path": str(self.path), "name": self.name, "coordinator": self.coordinator,
            "datalist": str(self.datalist), "task": self.task, "work_dir": str(self.work_dir),
            "ca_cert": str(self.ca_cert) if self.ca_cert else None,
            "private_key": str(self.private_key) if self.private_key else None,
            "approved_apps": list(self.approved_apps), "device": self.device, "threads": self.threads,
            "poll_interval": self.poll_interval, "runtime_port": self.runtime_port,
            "share_activations": self.share_activations, "allow_outside": self.allow_outside,
            "tolerate_orientation": self.tolerate_orientation,
            "privacy": None if self.privacy is None else {
                "noise_multiplier": self.privacy.noise_multiplier, "epsilon": self.privacy.epsilon,
                "clip_norm": self.privacy.clip_norm, "delta": self.privacy.delta},
        }


def load_site_config(path: Path, check_files: bool = True) -> SiteConfig:
    """Read and check ``site.toml``.

    Parameters
    ----------
    check_files
        Also check that the datalist, CA certificate and private key exist.
    """
    path = Path(path).absolute()
    doc = _read_toml(path, "site")
    unknown = sorted(set(doc) - {"site", "security", "bounds", "privacy"})
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {unknown}; use [site], [security], [bounds] and [privacy]")
    site = _table(doc, "site", path, _SITE_KEYS)
    where = f"{path} [site]"
    name = _get(site, "name", str, where, required=True)
    try:
        check_site_name(name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    coordinator = _get(site, "coordinator", str, where, required=True)
    parse_address(coordinator, where)
    task = _get(site, "task", str, where, required=True)
    try:
        get_task(task)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    base = path.parent
    datalist = base / _get(site, "datalist", str, where, required=True)
    device = _get(site, "device", str, where, "auto")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{where}: device = {device!r} must be 'auto', 'cpu' or 'cuda'")
    threads = _get(site, "threads", int, where, 0)
    if threads < 0:
        raise ConfigError(f"{where}: threads = {threads} must be >= 0 (0 = torch's default)")
    security = _table(doc, "security", path, _SECURITY_KEYS, required=False)
    sec_where = f"{path} [security]"
    approved = _get(security, "approved_apps", list, sec_where, [])
    try:
        approved_apps = tuple(normalise_app_hash(a) for a in approved)
    except ConfigError as exc:
        raise ConfigError(f"{sec_where}: {exc}") from None
    ca_cert = _get(security, "ca_cert", str, sec_where)
    private_key = _get(security, "private_key", str, sec_where)

    bounds = _table(doc, "bounds", path, None, required=False)
    SiteBounds.from_dict(bounds, f"{path} [bounds]")  # checked now, not when the first run arrives
    cfg = SiteConfig(
        path=path, name=name, coordinator=coordinator, datalist=datalist, task=task,
        work_dir=base / _get(site, "work_dir", str, where, f"{name}-work"),
        ca_cert=base / ca_cert if ca_cert else None,
        private_key=base / private_key if private_key else None,
        approved_apps=approved_apps, device=device, threads=threads,
        poll_interval=_positive(float(_get(site, "poll_interval", (int, float), where, 0.2)), "poll_interval", where),
        runtime_port=_port(_get(site, "runtime_port", int, where, 0), "runtime_port", where),
        share_activations=_get(site, "share_activations", bool, where, False),
        allow_outside=_get(site, "allow_outside", bool, where, False),
        tolerate_orientation=_tolerance(_get(site, "tolerate_orientation", (int, float), where, 0.0), where),
        bounds=dict(bounds),
        privacy=_privacy(doc, path),
    )
    if check_files:
        check_site_files(cfg, secure=True)
    return cfg


def _tolerance(value: float, where: str) -> float:
    """``[site] tolerate_orientation`` checked as ``--tolerate-orientation`` is (degrees in [0, max])."""
    if isinstance(value, bool) or not 0 <= float(value) <= MAX_TOLERATED_DEG:
        raise ConfigError(f"{where}: tolerate_orientation = {value!r} must be a number of degrees in "
                          f"[0, {MAX_TOLERATED_DEG:g}] (0 = masks must match the image's orientation)")
    return float(value)


def _privacy(doc: dict[str, Any], path: Path) -> PrivacySetting | None:
    """The ``[privacy]`` table as a :class:`PrivacySetting` (``None`` when absent)."""
    if "privacy" not in doc:
        return None
    table = _table(doc, "privacy", path, _PRIVACY_KEYS)
    where = f"{path} [privacy]"
    epsilon = _get(table, "epsilon", (int, float), where)
    try:
        return PrivacySetting(
            noise_multiplier=float(_get(table, "noise_multiplier", (int, float), where, 0.0)),
            epsilon=None if epsilon is None else float(epsilon),
            clip_norm=float(_get(table, "clip_norm", (int, float), where, 1.0)),
            delta=float(_get(table, "delta", (int, float), where, DEFAULT_DELTA)))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_site_files(cfg: SiteConfig, secure: bool) -> None:
    """Raise :class:`ConfigError` naming the first missing file a site needs."""
    if not cfg.datalist.is_file():
        raise ConfigError(f"{cfg.path}: datalist {cfg.datalist} does not exist; point [site] datalist at the "
                          "site's datalist.json")
    if not secure:
        return
    for key, value in (("ca_cert", cfg.ca_cert), ("private_key", cfg.private_key)):
        if value is None:
            raise ConfigError(f"{cfg.path} [security]: {key} is required (TLS and site authentication are on); "
                              "see docs/federation.md, or pass --insecure for a loopback demo")
        if not value.is_file():
            raise ConfigError(f"{cfg.path} [security]: {key} {value} does not exist")
