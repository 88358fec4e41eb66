"""The super-model file: global, personalized and selector weights in one ``.safetensors`` file.

Layout
------
Tensors are namespaced by the part of the super model they belong to::

    global.<key>             the FedAvg global U-Net
    personal.<site>.<key>    site ``<site>``'s personalized U-Net (site names contain no dots)
    selector.<key>           the model selector

The :class:`BundleMetadata` is one JSON string stored under the safetensors metadata key
``"fedsm"``. safetensors is a flat, pickle-free format: loading a bundle can never execute code,
whoever wrote the file.

Torch is imported inside the functions that need it, so reading a bundle's metadata
(:func:`read_metadata`) stays cheap for the desktop app.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

import engine
from engine import catalogue
from engine.bundle.schema import check_metadata
from engine.catalogue import ROUTINGS
from engine.errors import BundleError, ConfigError, DataError
from engine.io.atomic import atomic_path
from engine.io.guard import load_json
from engine.tasks import get_task

if TYPE_CHECKING:
    import torch

PathLike = str | os.PathLike[str]

#: Value of ``BundleMetadata.format``; anything else was not written by FedSM.
BUNDLE_FORMAT = "fedsm-supermodel"
#: Newest bundle layout this engine reads and the one it writes.
BUNDLE_FORMAT_VERSION = 1
#: safetensors metadata key holding the :class:`BundleMetadata` JSON.
METADATA_KEY = "fedsm"

#: Dialogue methods whose result is one model (a single-model bundle); weight methods say how their
#: bundle routes in the catalogue (:data:`engine.catalogue.WeightMethod.routing`).
SINGLE_MODEL_DIALOGUE_METHODS = ("fediod",)


def single_model_methods() -> tuple[str, ...]:
    """Methods whose result is one global model: a *single-model bundle* (routing ``"none"``: no
    selector, no personalized models; ``site_names`` are the sites that trained it)."""
    return (*catalogue.single_model_methods(), *SINGLE_MODEL_DIALOGUE_METHODS)


def routing_of_method(method: str) -> str | None:
    """How ``method``'s bundle routes (FedSM: a gamma threshold over K sites; FedSM-extra: an argmax over
    K+1 models; single-model bundles: ``"none"``); ``None`` for a method that writes no bundle."""
    if method in SINGLE_MODEL_DIALOGUE_METHODS:
        return "none"
    return catalogue.bundle_routing(method) if method in catalogue.method_names() else None

SELECTOR_HEADS = ("gap", "classic")
#: Selector backbone widths (:data:`engine.models.selector.SELECTOR_WIDTHS`, repeated here so that reading a
#: bundle's metadata needs no torch; tests/bundle check that the two agree).
SELECTOR_WIDTHS = (8, 16, 32, 64)
#: The selector width a run trains with when none is given: 16, a quarter of the paper's VGG-11 (64,
#: one option away: ``--selector-width 64``). Chosen by measurement (docs/results.md, "16-bit on the wire
#: and the selector's width"): through the routing a bundle applies (site-style gate, ``auto`` site
#: routing) width 16 routes seen and unseen sites as width 64 does, and sends 1/15 of its bytes.
#: A bundle's metadata without the field is the paper's 64 (:class:`SuperModelMeta`).
DEFAULT_SELECTOR_WIDTH = 16
#: How a FedSM bundle's personalized models were trained: SoftPull (the paper's) or one of the
#: alternatives of its Table 6, trained inside FedSM (:mod:`engine.fl.personalization`).
PERSONALIZATION_RULES = ("softpull", "finetune", "apfl", "perfedavg", "pfedme")
#: The rule a FedSM run trains with unless told otherwise: APFL, chosen by the measured evidence
#: (docs/results.md, "Personalization rules under FedSM's full routing path"): over 3 seeds of both
#: tasks it had the best paired result against FedAvg. SoftPull, the paper's, is
#: ``--personalization softpull``. A bundle's metadata without the field is SoftPull
#: (:class:`SuperModelMeta`: bundles written before the setting existed).
DEFAULT_PERSONALIZATION = "apfl"
#: Routed model 0 is the global model, so no site may be called that.
RESERVED_SITE_NAMES = ("global",)

_SITE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
#: safetensors itself refuses headers above 100 MB; a bigger length prefix means "not safetensors".
_MAX_HEADER_BYTES = 100_000_000
_HASH_CHUNK = 1 << 20


def _utc_now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def check_site_name(name: object) -> str:
    """Return ``name`` if it can name a site in a bundle, else raise :class:`ConfigError`.

    Site names become part of tensor names (``personal.<site>.<key>``), so they are limited
    to letters, digits, ``-`` and ``_``; a dot would make the namespace ambiguous.
    """
    if not isinstance(name, str) or not _SITE_NAME.match(name):
        raise ConfigError(
            f"site name {name!r} is not allowed; use only letters, digits, '-' and '_' (no dots or spaces)"
        )
    if name in RESERVED_SITE_NAMES:
        raise ConfigError(f"site name {name!r} is reserved for the global model; rename the site")
    return name


@dataclass
class BundleMetadata:
    """Everything needed to rebuild and use a super model, besides its weights.

    Attributes
    ----------
    task
        Task name (see :mod:`engine.tasks`): ``"fundus"`` or ``"prostate"``.
    label_names
        One output channel per structure, in channel order.
    in_channels
        Image channels the networks take.
    image_size
        Side of the square input of the U-Nets (multiple of 16).
    selector_size
        Side of the square input of the model selector (at least 32: VGG-11 halves it 5 times).
    site_names
        Sites in routing order: routed model ``k`` (1..K) is ``site_names[k - 1]``'s
        personalized model, model 0 is the global model.
    selector_head
        ``"gap"`` or ``"classic"`` (see :class:`engine.models.ModelSelector`).
    selector_width
        The selector backbone's first convolution width (64, the paper's VGG-11, in bundles
        written before the setting existed).
    normalisation
        Intensity scaling applied before the networks (the task's, e.g. ``"rgb/255"``).
    method
        ``"fedsm"`` (selector over K sites) or ``"fedsm-extra"`` (selector over K+1 models).
    routing
        ``"gamma"`` (Algorithm 2, goes with ``"fedsm"``) or ``"argmax"`` (Algorithm 4, goes
        with ``"fedsm-extra"``).
    lam
        SoftPull lambda used in training, in [1/K, 1] (recorded, unused, for other rules).
    personalization
        The rule that trained the personalized models (:data:`PERSONALIZATION_RULES`;
        ``"softpull"`` in bundles written before the setting existed).
    gamma
        Default routing threshold in [0, 1] (only used with ``routing="gamma"``).
    rounds
        Federated rounds trained.
    val_dice
        Per-site validation Dice of the routed super model (``None`` where not measured).
    site_validation
        Per site, the validation Dice its site measured for the final global model and for its
        own final personalized model: ``{"global": d, "personal": d}`` (either may be ``None``),
        and, from sites that report them, ``cases`` (validation cases) and ``diff_sd`` (standard
        deviation over cases of personalized minus global Dice) for the guard's paired test.
        Empty in bundles written before the routing guard existed.
    routing_guard
        Whether inference routes to a site's personalized model only where that model beat the
        global one in ``site_validation`` (see :mod:`engine.inference.guard`); ``False`` in
        bundles written before the guard existed, so they route as they always did.
    style_gate
        The site-style gate (:mod:`engine.fl.style_gate`), or ``{}`` (none: older bundles, or
        trained with ``--style-gate off``): ``descriptor`` (layout name), ``sites`` (the sites
        the gate knows, a subset of ``site_names``), ``means`` (one descriptor mean per such
        site), ``precision`` (the shared precision matrix), ``threshold`` (squared distance
        above which an image goes to the global model; ``null``: no limit) and ``quantile``.
    site_routing
        ``"selector"`` (default; the paper's selector and gamma) or ``"style"``: a FedSM bundle
        routes each image inside the style gate to its nearest site's model and the others to
        the global model; the selector still runs and is reported, gamma is not used. Needs a
        ``style_gate``.
    created
        Creation time, ISO 8601 UTC.
    engine_version
        ``engine.__version__`` of the writer.
    extra
        Free-form JSON-serialisable details (training settings, notes).
    format, format_version
        ``"fedsm-supermodel"`` and the layout version; set automatically.
    """

    task: str
    label_names: list[str]
    in_channels: int
    image_size: int
    selector_size: int
    site_names: list[str]
    selector_head: str = "gap"
    selector_width: int = 64
    normalisation: str = ""
    method: str = "fedsm"
    routing: str = "gamma"
    lam: float = 1.0
    personalization: str = "softpull"
    gamma: float = 0.5
    rounds: int = 0
    val_dice: dict[str, float | None] = field(default_factory=dict)
    site_validation: dict[str, dict[str, float | None]] = field(default_factory=dict)
    routing_guard: bool = False
    style_gate: dict[str, Any] = field(default_factory=dict)
    site_routing: str = "selector"
    created: str = field(default_factory=_utc_now)
    engine_version: str = engine.__version__
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = BUNDLE_FORMAT
    format_version: int = BUNDLE_FORMAT_VERSION

    def __post_init__(self) -> None:
        self.label_names = list(self.label_names)
        self.site_names = list(self.site_names)
        self.val_dice = dict(self.val_dice)
        self.site_validation = {k: dict(v) if isinstance(v, dict) else v for k, v in dict(self.site_validation).items()}
        self.extra = dict(self.extra)
        self.style_gate = dict(self.style_gate)
        if not self.normalisation:
            self.normalisation = get_task(self.task).normalisation
        self.validate()

    @property
    def num_sites(self) -> int:
        """K, the number of sites (and personalized models)."""
        return len(self.site_names)

    @property
    def selector_classes(self) -> int:
        """Outputs of the selector: K for gamma routing, K+1 (global first) for argmax routing, 0 without one."""
        if self.routing == "none":
            return 0
        return self.num_sites + (1 if self.routing == "argmax" else 0)

    @property
    def single_model(self) -> bool:
        """Whether this is a single-model bundle (FedAvg, FedProx, Scaffold: the global model only)."""
        return self.routing == "none"

    @property
    def personal_sites(self) -> list[str]:
        """Sites with a personalized model in the bundle: all of ``site_names``, none for a single model."""
        return [] if self.single_model else list(self.site_names)

    @property
    def model_names(self) -> list[str]:
        """Name of every routable model by index: ``["global", site_1, ..., site_K]`` (``["global"]`` alone
        for a single-model bundle)."""
        return ["global", *self.personal_sites]

    def validate(self) -> None:
        """Check every field and their consistency; raise :class:`ConfigError` on the first problem."""
        if self.format != BUNDLE_FORMAT:
            raise ConfigError(f"format must be {BUNDLE_FORMAT!r}, got {self.format!r}")
        if self.format_version != BUNDLE_FORMAT_VERSION:
            raise ConfigError(f"format_version must be {BUNDLE_FORMAT_VERSION}, got {self.format_version!r}")
        task = get_task(self.task)
        if _not_int(self.in_channels) or self.in_channels != task.in_channels:
            raise ConfigError(
                f"in_channels is {self.in_channels!r} but task {task.name!r} takes {task.in_channels}"
            )
        if not self.label_names or not all(isinstance(n, str) and n for n in self.label_names):
            raise ConfigError(f"label_names must be a non-empty list of names, got {self.label_names!r}")
        if len(self.label_names) != task.out_channels:
            raise ConfigError(
                f"task {task.name!r} has {task.out_channels} labels {list(task.label_names)}, "
                f"got {self.label_names!r}"
            )
        if _not_int(self.image_size) or self.image_size < 16 or self.image_size % 16:
            raise ConfigError(
                f"image_size must be a positive multiple of 16 (the U-Net downsamples 4 times), "
                f"got {self.image_size!r}"
            )
        if _not_int(self.selector_size) or self.selector_size < 32:
            raise ConfigError(
                f"selector_size must be at least 32 (VGG-11 halves it 5 times), got {self.selector_size!r}"
            )
        if self.selector_head not in SELECTOR_HEADS:
            raise ConfigError(f"selector_head must be one of {SELECTOR_HEADS}, got {self.selector_head!r}")
        if _not_int(self.selector_width) or self.selector_width not in SELECTOR_WIDTHS:
            raise ConfigError(f"selector_width must be one of {SELECTOR_WIDTHS}, got {self.selector_width!r}")
        if self.normalisation != task.normalisation:
            raise ConfigError(
                f"normalisation {self.normalisation!r} does not match task {task.name!r} "
                f"({task.normalisation!r})"
            )
        if not self.site_names:
            raise ConfigError("site_names is empty; a super model needs at least one site")
        for name in self.site_names:
            check_site_name(name)
        if len(set(self.site_names)) != len(self.site_names):
            raise ConfigError(f"site_names has duplicates: {self.site_names}; give every site its own name")
        method_routing = routing_of_method(self.method)
        if method_routing is None:
            bundled = (m for m in catalogue.method_names() if catalogue.bundle_routing(m))
            known = (*bundled, *SINGLE_MODEL_DIALOGUE_METHODS)
            raise ConfigError(f"method must be one of {known}, got {self.method!r}")
        if self.routing not in ROUTINGS:
            raise ConfigError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if method_routing != self.routing:
            raise ConfigError(f"method {self.method!r} routes with {method_routing!r}, not {self.routing!r}")
        if not _is_number(self.lam) or not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"lam must be a number in [0, 1] (FedSM uses [1/K, 1]), got {self.lam!r}")
        if self.personalization not in PERSONALIZATION_RULES:
            raise ConfigError(f"personalization must be one of {PERSONALIZATION_RULES}, got {self.personalization!r}")
        if not _is_number(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"gamma must be a number in [0, 1], got {self.gamma!r}")
        if _not_int(self.rounds) or self.rounds < 0:
            raise ConfigError(f"rounds must be a non-negative integer, got {self.rounds!r}")
        for site, dice in self.val_dice.items():
            if site not in self.site_names:
                raise ConfigError(f"val_dice names site {site!r}, not one of site_names {self.site_names}")
            if dice is not None and (not _is_number(dice) or not 0.0 <= dice <= 1.0):
                raise ConfigError(f"val_dice[{site!r}] must be a number in [0, 1] or null, got {dice!r}")
        if not isinstance(self.routing_guard, bool):
            raise ConfigError(f"routing_guard must be true or false, got {self.routing_guard!r}")
        for site, scores in self.site_validation.items():
            if site not in self.site_names:
                raise ConfigError(f"site_validation names site {site!r}, not one of site_names {self.site_names}")
            if not isinstance(scores, dict) or not set(scores) <= {"global", "personal", "cases", "diff_sd"}:
                raise ConfigError(f"site_validation[{site!r}] must map 'global' and 'personal' to Dice values "
                                  f"(and optionally 'cases' and 'diff_sd'), got {scores!r}")
            cases = scores.get("cases")
            if cases is not None and (not _is_number(cases) or cases < 0 or cases != round(cases)):
                raise ConfigError(f"site_validation[{site!r}]['cases'] must be a whole number >= 0 or null, "
                                  f"got {cases!r}")
            for which, dice in scores.items():
                if which == "cases":
                    continue
                if dice is not None and (not _is_number(dice) or not 0.0 <= dice <= 1.0):
                    raise ConfigError(f"site_validation[{site!r}][{which!r}] must be a number in [0, 1] or null, "
                                      f"got {dice!r}")
        from engine.models.style_gate_format import SITE_ROUTINGS, check_gate_metadata

        if self.style_gate:
            check_gate_metadata(self.style_gate, self.site_names, self.in_channels)
        if self.site_routing not in SITE_ROUTINGS:
            raise ConfigError(f"site_routing must be one of {SITE_ROUTINGS}, got {self.site_routing!r}")
        if self.site_routing == "style" and (self.routing != "gamma" or not self.style_gate):
            raise ConfigError("site_routing 'style' needs a FedSM bundle with a site-style gate; this one has "
                              f"routing {self.routing!r} and {'a' if self.style_gate else 'no'} gate")
        if not isinstance(self.created, str) or not isinstance(self.engine_version, str):
            raise ConfigError("created and engine_version must be strings")

    def to_json(self) -> str:
        """Serialise to a JSON string (keys sorted, no NaN)."""
        self.validate()
        try:
            return json.dumps(asdict(self), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bundle metadata is not JSON-serialisable ({exc}); check 'extra'") from exc

    @classmethod
    def from_json(cls, text: str) -> BundleMetadata:
        """Parse and validate metadata written by :meth:`to_json`.

        Raises
        ------
        BundleError
            When the text is not FedSM metadata, comes from a newer FedSM, or is inconsistent.
        """
        if not isinstance(text, str):
            raise BundleError(f"its FedSM metadata is a {type(text).__name__}, not JSON text; it was not written by "
                              "FedSM")
        try:
            raw = load_json(text, "its FedSM metadata")
        except DataError as exc:
            raise BundleError(str(exc)) from None
        if not isinstance(raw, dict) or raw.get("format") != BUNDLE_FORMAT:
            raise BundleError(f"it was not written by FedSM (metadata format is not {BUNDLE_FORMAT!r})")
        # The version is checked before anything else: a newer layout may have other fields.
        version = raw.get("format_version")
        if _not_int(version):
            raise BundleError(f"its format_version {version!r} is not an integer")
        if version > BUNDLE_FORMAT_VERSION:
            raise BundleError(
                f"it uses super-model format version {version}, but this FedSM "
                f"({engine.__version__}) reads up to version {BUNDLE_FORMAT_VERSION}; upgrade FedSM"
            )
        if version < BUNDLE_FORMAT_VERSION:
            raise BundleError(f"its super-model format version {version} is not supported; re-export it")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BundleError(f"its metadata has unknown fields {unknown}; it may come from a newer FedSM")

        check_metadata(raw)
        try:
            return cls(**raw)
        except TypeError as exc:
            raise BundleError(f"its metadata is incomplete or malformed ({exc})") from exc
        except ConfigError as exc:
            raise BundleError(f"its metadata is invalid: {exc}") from exc


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _not_int(value: object) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


@dataclass
class SuperModelBundle:
    """A complete super model in memory.

    Attributes
    ----------
    metadata
        See :class:`BundleMetadata`.
    global_weights
        State dict of the global U-Net.
    personal_weights
        Site name -> state dict of that site's personalized U-Net, for every site in
        ``metadata.site_names``.
    selector_weights
        State dict of the model selector.
    source
        The file the bundle was loaded from (``None`` when built in memory); used in messages.
    """

    metadata: BundleMetadata
    global_weights: dict[str, torch.Tensor]
    personal_weights: dict[str, dict[str, torch.Tensor]]
    selector_weights: dict[str, torch.Tensor]
    source: str | None = None

    def describe(self) -> str:
        """Short name for messages: the source file, or the task and sites."""
        if self.source:
            return self.source
        return f"super model for {self.metadata.task} ({', '.join(self.metadata.site_names)})"


def file_sha256(path: PathLike) -> str:
    """SHA-256 hex digest of a file, read in chunks (bundles can be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _flatten(bundle: SuperModelBundle) -> dict[str, torch.Tensor]:
    """Namespace every tensor; detached, on CPU, contiguous, and sharing no storage.

    safetensors refuses tensors that share storage (tied weights, views of one buffer), so a
    tensor whose storage was already seen is cloned.
    """
    meta = bundle.metadata
    declared, given = set(meta.personal_sites), set(bundle.personal_weights)
    if declared != given:
        raise ConfigError(
            f"personal weights are for sites {sorted(given)} but metadata declares {meta.site_names}; "
            "give one personalized model per declared site"
        )
    parts: list[tuple[str, dict[str, torch.Tensor]]] = [("global", bundle.global_weights)]
    parts += [(f"personal.{site}", bundle.personal_weights[site]) for site in meta.personal_sites]
    if not meta.single_model:
        parts.append(("selector", bundle.selector_weights))

    flat: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for prefix, weights in parts:
        if not weights:
            raise ConfigError(f"{prefix} weights are empty; pass the model's full state_dict")
        for key, tensor in weights.items():
            t = tensor.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen_storage and t.numel() > 0:
                t = t.clone()
            seen_storage.add(t.untyped_storage().data_ptr())
            flat[f"{prefix}.{key}"] = t
    return flat


def save_bundle(path: PathLike, bundle: SuperModelBundle) -> str:
    """Write ``bundle`` to ``path`` atomically (temporary file + rename).

    Returns
    -------
    str
        SHA-256 hex digest of the written file (for ledgers and ``routing.json``).

    Raises
    ------
    ConfigError
        When the metadata is invalid, a site name is unsafe, or personal weights do not match
        the declared sites.
    """
    from safetensors.torch import save_file

    flat = _flatten(bundle)
    header = {METADATA_KEY: bundle.metadata.to_json()}
    with atomic_path(path) as tmp:
        save_file(flat, str(tmp), metadata=header)
        # Hash the temporary file: it is byte-for-byte what the rename puts in place.
        digest = file_sha256(tmp)
    return digest


def _read_header(path: Path) -> dict[str, Any]:
    """Read and sanity-check a safetensors header without loading any tensor.

    The checks exist to turn "random bytes", "a PNG renamed" and "a file cut short" into a
    sentence instead of a low-level deserialisation error.
    """
    if not path.exists():
        raise BundleError(f"{path}: file not found; check the path to the super-model (.safetensors) file")
    if not path.is_file():
        raise BundleError(f"{path}: is a folder, not a super-model file; choose the .safetensors file inside")
    size = path.stat().st_size
    not_safetensors = (
        f"{path}: not a FedSM super-model file (not a valid safetensors file, or truncated); "
        "choose a .safetensors bundle exported by FedSM, or copy it again"
    )
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise BundleError(f"{not_safetensors} [only {size} bytes]")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise BundleError(
                    f"{not_safetensors} [header length {header_len} does not fit a {size}-byte file]"
                )
            header_bytes = fh.read(header_len)
    except OSError as exc:
        raise BundleError(f"{path}: cannot be read ({exc}); check permissions") from exc

    try:
        header = load_json(header_bytes, "header")
    except DataError as exc:
        raise BundleError(f"{not_safetensors} [{exc}]") from None
    if not isinstance(header, dict):
        raise BundleError(f"{not_safetensors} [header is not a JSON object]")
    data_len = size - 8 - header_len
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise BundleError(f"{not_safetensors} [tensor {name!r} has no valid data offsets]")
        end = max(end, offsets[1])
    if end > data_len:
        raise BundleError(
            f"{path}: the file is truncated (its tensors need {end} bytes of data, it holds {data_len}); "
            "copy or download the bundle again"
        )
    return header


def check_bundle_file(path: PathLike) -> None:
    """Check, without torch, that ``path`` is a whole safetensors file (any kind of FedSM bundle).

    ``fedsm infer`` and ``fedsm evaluate`` call it before they import the compute stack, so a wrong
    path, a foreign or a truncated file is reported at once instead of after the seconds torch and
    MONAI take to import.

    Raises
    ------
    BundleError
        As :func:`load_bundle`, for a missing, foreign or truncated file.
    """
    _read_header(Path(path))


def read_metadata(path: PathLike) -> BundleMetadata:
    """Read only a bundle's metadata (no tensors, no torch import): cheap, for display.

    Raises
    ------
    BundleError
        As :func:`load_bundle`, for problems visible in the header.
    """
    p = Path(path)
    header = _read_header(p)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not isinstance(meta.get(METADATA_KEY), str):
        raise BundleError(
            f"{p}: this safetensors file was not written by FedSM (it has no {METADATA_KEY!r} metadata); "
            "choose a super-model bundle exported by FedSM"
        )
    try:
        return BundleMetadata.from_json(meta[METADATA_KEY])
    except BundleError as exc:
        raise BundleError(f"{p}: {exc}") from exc


def load_bundle(path: PathLike) -> SuperModelBundle:
    """Load a super model written by :func:`save_bundle`. Never unpickles anything.

    Whether the weights fit the networks is checked when they are loaded into them
    (:class:`engine.inference.predictor.SuperModelPredictor`), where the networks exist.

    Raises
    ------
    BundleError
        With the path and what to do, when the file is missing, not safetensors, truncated or
        corrupt, not written by FedSM, from a newer format version, or lacks tensors for a part
        of the super model.
    """
    p = Path(path)
    metadata = read_metadata(p)
    global_weights: dict[str, torch.Tensor] = {}
    selector_weights: dict[str, torch.Tensor] = {}
    personal: dict[str, dict[str, torch.Tensor]] = {site: {} for site in metadata.personal_sites}
    try:
        with safe_open(str(p), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                part, _, rest = name.partition(".")
                if part == "global" and rest:
                    global_weights[rest] = fh.get_tensor(name)
                elif part == "selector" and rest:
                    selector_weights[rest] = fh.get_tensor(name)
                elif part == "personal" and "." in rest:
                    site, _, key = rest.partition(".")
                    if site not in personal:
                        raise BundleError(
                            f"{p}: holds weights for site {site!r}, which its metadata does not declare "
                            f"(sites: {metadata.personal_sites}); the file is inconsistent, export it again"
                        )
                    personal[site][key] = fh.get_tensor(name)
                else:
                    raise BundleError(
                        f"{p}: unexpected tensor {name!r} (expected global.*, personal.<site>.* or "
                        "selector.*); the file is inconsistent, export it again"
                    )
    except SafetensorError as exc:
        raise BundleError(
            f"{p}: the safetensors data is corrupt ({exc}); copy or export the bundle again"
        ) from exc
    missing = [f"site {site!r}" for site, w in personal.items() if not w]
    if not global_weights:
        missing.insert(0, "the global model")
    if not selector_weights and not metadata.single_model:
        missing.append("the model selector")
    if missing:
        raise BundleError(
            f"{p}: has no weights for {', '.join(missing)}; the file is incomplete, export it again"
        )
    return SuperModelBundle(metadata, global_weights, personal, selector_weights, source=str(p))
