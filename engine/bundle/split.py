"""Split-network bundles (BlackFed): per-site client nets and the server net in one ``.safetensors`` file.

Layout
------
::

    client.<site>.<key>    site ``<site>``'s client net f_k (two convolutions)
    server.<key>           the last server net g (v1 uses it for every site)
    table.<site>.<key>     v2 only: the server net stored after ``<site>``'s turn

The :class:`SplitMetadata` is one JSON string under the safetensors metadata key
``"fedsm-split"``; ``server`` says which server net each site uses (``"shared"`` = v1,
``"per-site"`` = v2). A bundle built at one site of a network run holds only that site's
client net: :func:`site_split_bundle` (``server`` = the server net the coordinator sent that site
once after the last round; ``extra["assembled_at"]`` names the site). Loading never unpickles
anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

import engine
from engine.bundle.supermodel import PathLike, _read_header, check_site_name, file_sha256
from engine.errors import BundleError, ConfigError, DataError
from engine.io.atomic import atomic_path
from engine.io.guard import load_json
from engine.tasks import get_task

if TYPE_CHECKING:
    import torch

SPLIT_FORMAT = "fedsm-split"
SPLIT_FORMAT_VERSION = 1
SPLIT_METADATA_KEY = "fedsm-split"
SERVER_MODES = ("shared", "per-site")


@dataclass
class SplitMetadata:
    """What is needed to rebuild a split network, besides its weights."""

    task: str
    label_names: list[str]
    in_channels: int
    image_size: int
    normalisation: str
    method: str
    server: str
    channels: int
    site_names: list[str]
    format: str = SPLIT_FORMAT
    format_version: int = SPLIT_FORMAT_VERSION
    created: str = field(default_factory=lambda: datetime.now(UTC).replace(microsecond=0).isoformat())
    fedsm_version: str = field(default_factory=lambda: getattr(engine, "__version__", "unknown"))
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        task = get_task(self.task)
        if list(self.label_names) != list(task.label_names) or self.in_channels != task.in_channels:
            raise ConfigError(f"labels {self.label_names} / {self.in_channels} channels do not fit task {self.task}")
        if self.server not in SERVER_MODES:
            raise ConfigError(f"server must be one of {SERVER_MODES}, got {self.server!r}")
        if self.image_size < 16 or self.image_size % 16 or self.channels < 1:
            raise ConfigError(f"image_size {self.image_size} (multiple of 16) or channels {self.channels} invalid")
        if not self.site_names:
            raise ConfigError("a split bundle needs at least one site's client net")
        for name in self.site_names:
            check_site_name(name)

    def to_json(self) -> str:
        self.validate()
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SplitMetadata:
        if not isinstance(text, str):
            raise BundleError(f"its split-network metadata is a {type(text).__name__}, not JSON text")
        try:  # nesting bounded: a deeply nested value is an error, not a RecursionError
            raw = load_json(text, "its split-network metadata")
        except DataError as exc:
            raise BundleError(str(exc)) from None
        if not isinstance(raw, dict) or raw.get("format") != SPLIT_FORMAT:
            raise BundleError(f"it was not written by FedSM (metadata format is not {SPLIT_FORMAT!r})")
        version = raw.get("format_version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise BundleError(f"its split-bundle format_version {version!r} is not an integer")
        if version > SPLIT_FORMAT_VERSION:
            raise BundleError(f"it uses split-bundle version {raw['format_version']}; update FedSM to open it")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise BundleError(f"its metadata has unknown fields {unknown}; it may come from a newer FedSM")
        try:
            meta = cls(**raw)
            meta.validate()
        except (TypeError, ConfigError) as exc:
            raise BundleError(f"its metadata is invalid: {exc}") from None
        return meta


@dataclass
class SplitBundle:
    """A split network: each site's client net, the server net, and (v2) the per-site server table."""

    metadata: SplitMetadata
    clients: dict[str, dict[str, torch.Tensor]]
    server: dict[str, torch.Tensor]
    table: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    source: str | None = None

    def server_for(self, site: str) -> dict[str, torch.Tensor]:
        """The server weights ``site`` segments with (v2: its table entry when present)."""
        if self.metadata.server == "per-site" and site in self.table:
            return self.table[site]
        return self.server

    def describe(self) -> str:
        return (f"{self.metadata.method} split network for {self.metadata.task} "
                f"(client nets: {', '.join(self.metadata.site_names)})")


def _flatten(bundle: SplitBundle) -> dict[str, torch.Tensor]:
    meta = bundle.metadata
    if sorted(bundle.clients) != sorted(meta.site_names):
        raise ConfigError(f"client nets for {sorted(bundle.clients)} but metadata declares {meta.site_names}")
    if not bundle.server:
        raise ConfigError("a split bundle needs the server net")
    flat = {f"server.{k}": v for k, v in bundle.server.items()}
    for site, weights in bundle.clients.items():
        flat |= {f"client.{site}.{k}": v for k, v in weights.items()}
    for site, weights in bundle.table.items():
        check_site_name(site)
        flat |= {f"table.{site}.{k}": v for k, v in weights.items()}
    return {k: v.detach().cpu().contiguous() for k, v in flat.items()}


def save_split_bundle(path: PathLike, bundle: SplitBundle) -> str:
    """Write ``bundle`` atomically; return the file's SHA-256."""
    from safetensors.torch import save_file

    header = {SPLIT_METADATA_KEY: bundle.metadata.to_json()}
    flat = _flatten(bundle)
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata=header)
        digest = file_sha256(tmp)
    return digest


def is_split_bundle(path: PathLike) -> bool:
    """Whether ``path`` is a FedSM split bundle (reads the header only; False for anything else)."""
    try:
        meta = _read_header(Path(path)).get("__metadata__")
    except BundleError:
        return False
    return isinstance(meta, dict) and SPLIT_METADATA_KEY in meta


def read_split_metadata(path: PathLike) -> SplitMetadata:
    """Only the metadata of a split bundle (no tensors)."""
    p = Path(path)
    meta = _read_header(p).get("__metadata__")
    if not isinstance(meta, dict) or SPLIT_METADATA_KEY not in meta:
        raise BundleError(f"{p}: not a FedSM split-network bundle (no {SPLIT_METADATA_KEY!r} metadata)")
    try:
        return SplitMetadata.from_json(meta[SPLIT_METADATA_KEY])
    except BundleError as exc:
        raise BundleError(f"{p}: {exc}") from None


def load_split_bundle(path: PathLike) -> SplitBundle:
    """Load a bundle written by :func:`save_split_bundle`; never unpickles."""
    p = Path(path)
    meta = read_split_metadata(p)
    clients: dict[str, dict[str, torch.Tensor]] = {s: {} for s in meta.site_names}
    server: dict[str, torch.Tensor] = {}
    table: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(p), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                part, _, rest = name.partition(".")
                site, _, key = rest.partition(".")
                if part == "server" and rest:
                    server[rest] = fh.get_tensor(name)
                elif part == "client" and key and site in clients:
                    clients[site][key] = fh.get_tensor(name)
                elif part == "table" and key:
                    table.setdefault(site, {})[key] = fh.get_tensor(name)
                else:
                    raise BundleError(f"{p}: unexpected tensor {name!r}; the file is inconsistent, export it again")
    except SafetensorError as exc:
        raise BundleError(f"{p}: the safetensors data is corrupt ({exc}); copy or export it again") from exc
    missing = [s for s, w in clients.items() if not w]
    if not server or missing:
        raise BundleError(f"{p}: incomplete split bundle (server net {'present' if server else 'missing'}, "
                          f"client nets missing for {missing}); export it again")
    return SplitBundle(meta, clients, server, table, source=str(p))


def split_bundle_from_state(method: Any, state: dict[str, Any], clients: dict[str, dict[str, torch.Tensor]],
                            image_size: int) -> SplitBundle:
    """The bundle of a trained :class:`engine.fl.blackfed.BlackFed` run (server state + client nets)."""
    task = method.task
    per_site = method.variant == "v2"
    meta = SplitMetadata(task=task.name, label_names=list(task.label_names), in_channels=task.in_channels,
                         image_size=int(image_size), normalisation=task.normalisation, method=method.name,
                         server="per-site" if per_site else "shared", channels=method.config.channels,
                         site_names=list(clients))
    table = {k.split("/", 1)[1]: v for k, v in state.items() if k.startswith("server/")} if per_site else {}
    return SplitBundle(meta, dict(clients), dict(state["server"]), table)


def site_split_bundle(method: Any, site: str, client: dict[str, torch.Tensor], server: dict[str, torch.Tensor],
                      image_size: int, extra: dict[str, Any] | None = None) -> SplitBundle:
    """The bundle one site of a network run assembles: its own client net and the server net it was sent.

    ``server`` is the server net this site segments with (v1: the last ``g``; v2: the copy stored
    after this site's turn), so the bundle holds no table: :meth:`SplitBundle.server_for` gives
    ``server`` for the one site either way.
    """
    task = method.task
    meta = SplitMetadata(task=task.name, label_names=list(task.label_names), in_channels=task.in_channels,
                         image_size=int(image_size), normalisation=task.normalisation, method=method.name,
                         server="per-site" if method.variant == "v2" else "shared", channels=method.config.channels,
                         site_names=[site], extra={"assembled_at": site, **dict(extra or {})})
    return SplitBundle(meta, {site: dict(client)}, dict(server))


__all__ = ["SplitBundle", "SplitMetadata", "is_split_bundle", "load_split_bundle", "read_split_metadata",
           "save_split_bundle", "site_split_bundle", "split_bundle_from_state"]
