"""The engine's public facade: what the CLI and the desktop app call.

Importing this module is cheap (no torch, no MONAI, no numpy); each call imports the heavy modules it needs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import (
    BundleError,
    CancelledError,
    ConfigError,
    DataError,
    DeviceError,
    FedSMError,
    WeightsError,
)
from engine.federation.demo_site import demo_site_command as _demo_site_command
from engine.federation.flower.app_bundle import build_app_bundle
from engine.io.export import export_mask as _export_mask
from engine.io.export import read_provenance as _read_provenance
from engine.io.label_conventions import convention_from_name
from engine.io.masks import open_mask as _open_mask_file
from engine.io.privacy import mask_stem
from engine.io.readers import list_series as _list_series_at
from engine.io.readers import open_study as _open_study_at
from engine.security.run_review import review_rows
from engine.security.run_spec import format_settings

if TYPE_CHECKING:  # types only: importing them at run time would pull in numpy-heavy modules
    from engine.inference.cup_disc import CupToDisc
    from engine.inference.study import StudySegmentation
    from engine.io.provenance import Provenance
    from engine.io.study import LabelMap, SeriesInfo, Study

ProgressFn = Callable[[dict[str, Any]], None]

__all__ = [
    "BundleError",
    "CancelledError",
    "ConfigError",
    "DataError",
    "DeviceError",
    "FedSMError",
    "WeightsError",
    "app_hash",
    "benchmark",
    "cup_to_disc_ratio",
    "demo_site_command",
    "describe_device",
    "export_mask",
    "infer",
    "list_series",
    "mask_file_stem",
    "open_mask",
    "open_study",
    "preload_super_model",
    "prepare_demo",
    "read_bundle_metadata",
    "read_provenance",
    "read_site_config",
    "segment_study",
    "simulate",
    "site_command",
    "synthesize",
    "validate_data",
]


def synthesize(task: str, sites: int, out_dir: Path, image_size: int = 256, seed: int = 0) -> list[Path]:
    """Write synthetic multi-site data; return each site's datalist path."""
    from engine.data.synth import generate_federation

    return generate_federation(task, sites, Path(out_dir), image_size=image_size, seed=seed)


def simulate(out_dir: Path, progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
             **settings: Any) -> dict[str, Any]:
    """Run ``fedsm simulate`` in-process; ``settings`` are :class:`engine.simulate.SimulationConfig` fields."""
    from engine.simulate import SimulationConfig, run_simulation

    if "methods" in settings:
        settings["methods"] = tuple(settings["methods"])
    return run_simulation(SimulationConfig(**settings), Path(out_dir), progress, cancel)


def list_series(path: Path) -> list[SeriesInfo]:
    """What can be opened at ``path`` (DICOM series of a folder, or the file itself), from headers only."""
    return _list_series_at(Path(path))


def open_study(path: Path, series_uid: str | None = None, progress: ProgressFn | None = None,
               cancel: Callable[[], bool] | None = None) -> Study:
    """Open a photo, a NIfTI/MHA/NRRD volume or a DICOM series (``series_uid`` picks one of a folder's)."""
    return _open_study_at(Path(path), series_uid=series_uid, progress=progress, cancel=cancel)


def open_mask(path: Path, study: Study, convention: str | None = None) -> LabelMap:
    """Read a mask aligned voxel for voxel with ``study`` (PNG, NIfTI, MHA/NRRD, DICOM labels or SEG).

    ``convention="auto"`` takes the convention the file name identifies (a Drishti-GS soft map
    opens as one binarised disc/cup map with its partner file), else the values as stored.
    """
    if convention == "auto":
        convention = convention_from_name(path)
    return _open_mask_file(Path(path), study, convention)


def validate_data(datalists: list[Path], convention: str | None = None, task: str | None = None,
                  progress: ProgressFn | None = None) -> dict[str, Any]:
    """Check site datalists (``fedsm validate-data``): a JSON-able report with per-file problems and counts."""
    from engine.data.validation import validate_datalists

    return validate_datalists([Path(p) for p in datalists], convention=convention, task=task, progress=progress)


def build_datalist(images_dir: Path, masks_dir: Path, out: Path, **options: Any) -> Any:
    """Pair images with masks by name, split by case (seeded) and write a datalist (``fedsm datalist``).

    ``options`` are :func:`engine.data.datalist_builder.build_datalist`'s keywords (task, convention,
    name, split, seed, mask_suffix, case_pattern, allow_outside); returns its ``BuildResult``.
    """
    from engine.data.datalist_builder import build_datalist as build

    return build(Path(images_dir), Path(masks_dir), Path(out), **options)


def infer(model: Path, input_path: Path, out_dir: Path, gamma: float | None = None, device: str = "auto",
          progress: Callable[[int, int], None] | None = None, cancel: Callable[[], bool] | None = None,
          mask_format: str | None = None, force_model: str | None = None, site: str | None = None,
          keep_names: bool = False, name_map: Path | None = None) -> dict[str, Any]:
    """Segment a photo, a volume, a DICOM series or a folder of them; masks as ``mask_format``; see ``fedsm infer``.

    ``force_model`` (``"global"`` or a site name) sends every image to that model instead of routing.
    ``site``: which site's client net a split-network (BlackFed) bundle uses (required there; the
    same as ``force_model`` with the site's name). Masks and ``routing.json`` name each input by the
    hash of its content (``case-3f2a9c01d4``) unless ``keep_names``; ``name_map``: a file to write
    which case is which input to.
    """
    from engine.inference.run import infer_path

    return infer_path(Path(model), Path(input_path), Path(out_dir), gamma=gamma, device=device, progress=progress,
                      cancel=cancel, mask_format=mask_format, force_model=force_model or site,
                      keep_names=keep_names, name_map=name_map)


def mask_file_stem(study: Study, keep_names: bool = False) -> str:
    """The name a mask of ``study`` gets before ``_mask.<ext>``: ``case-`` + the hash of its files' content,
    or with ``keep_names`` the source's own name (``case7.nii.gz`` -> ``case7``). Hashing reads the
    study's files: call it off the GUI thread."""
    return mask_stem(study, keep_names)


def evaluate(model: Path, datalists: list[Path], split: str = "testing", model_choice: str = "routed",
             gamma: float | None = None, device: str = "auto",
             progress: Callable[[str], None] | None = None, keep_names: bool = False,
             name_map: Path | None = None) -> dict[str, Any]:
    """Dice and HD95 of a bundle against the expert masks of site datalists (``fedsm evaluate``).

    Per-image rows name images by the hash of their content unless ``keep_names``.
    """
    from engine.inference.evaluate import evaluate_bundle

    return evaluate_bundle(Path(model), [Path(p) for p in datalists], split=split, model_choice=model_choice,
                           gamma=gamma, device=device, progress=progress, keep_names=keep_names,
                           name_map=name_map)


def bundle_sites(path: Path) -> dict[str, Any]:
    """What the app shows when a bundle is opened: its kind, method and the sites one can choose.

    ``{"kind": "split", "method": "blackfed-v2", "sites": [...], "server": "per-site"}`` for a
    BlackFed bundle (the user must pick a site's client net), ``{"kind": "supermodel", ...}``
    otherwise (the selector routes). Reads the header only.
    """
    from engine.bundle import read_metadata
    from engine.bundle.split import is_split_bundle, read_split_metadata

    if is_split_bundle(Path(path)):
        meta = read_split_metadata(Path(path))
        return {"kind": "split", "method": meta.method, "sites": list(meta.site_names), "server": meta.server,
                "task": meta.task}
    sm = read_metadata(Path(path))
    return {"kind": "supermodel", "method": sm.method, "sites": list(sm.site_names), "task": sm.task}


def read_bundle_metadata(path: Path) -> dict[str, Any]:
    """A bundle's metadata as a plain dict (sites, rounds, lambda, gamma, validation Dice, ...).

    A split-network (BlackFed) bundle gives its own metadata with ``routing = "site"``: no
    selector routes, the user chooses whose client net segments.
    """
    from engine.bundle import load_bundle
    from engine.bundle.split import is_split_bundle, load_split_bundle

    if is_split_bundle(Path(path)):
        meta = json.loads(load_split_bundle(Path(path)).metadata.to_json())
        return {**meta, "routing": "site"}
    return json.loads(load_bundle(Path(path)).metadata.to_json())


def demo_site_command(workdir: Path, site: str = "site1", rounds: int = 3) -> list[str]:
    """Command line of a simulated site (``python -m engine.federation.demo_site``) for the app's Join."""
    return _demo_site_command(Path(workdir), site=site, rounds=rounds)


def preload_super_model(path: Path, device: str = "auto") -> dict[str, Any]:
    """Load a bundle's networks into the inference cache, so the next ``segment_study`` with it starts at once.

    Returns ``{"sha256", "device"}`` of the loaded model. The desktop app calls it when a bundle is
    opened (in a worker), so Run does not first spend seconds importing MONAI and building networks.
    """
    from engine.inference.study import load_predictor

    loaded = load_predictor(Path(path), device)
    return {"sha256": loaded.sha256, "device": str(loaded.predictor.device)}


def prepare_demo(cache_dir: Path, progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
                 **settings: Any) -> dict[str, Any]:
    """The app's demo (super model, study, reference mask): the shipped one (``resources/fedsm_demo``), a retrained
    one from ``cache_dir``, or (``retrain=True`` in ``settings``) trained now and cached; see ``engine.demo``."""
    from engine.demo import prepare_demo as prepare

    return prepare(Path(cache_dir), progress, cancel, **settings)


def segment_study(model: Path, study: Study, gamma: float | None = None, device: str = "auto",
                  force_model: str | int | None = None, batch_size: int = 16,
                  progress: Callable[[int, int], None] | None = None,
                  cancel: Callable[[], bool] | None = None) -> StudySegmentation:
    """Segment an opened study with a super model (cached per bundle and device); see ``engine.inference.study``."""
    from engine.inference.study import segment_study as segment

    return segment(Path(model), study, gamma=gamma, device=device, force_model=force_model,
                   batch_size=batch_size, progress=progress, cancel=cancel)


def cup_to_disc_ratio(labels: Any, names: dict[int, str]) -> CupToDisc | None:
    """Vertical cup-to-disc ratio of a fundus label map on cleaned masks, with whether to trust it.

    See :func:`engine.inference.cup_disc.vertical_cup_to_disc`; ``None`` when ``labels`` holds no disc.
    """
    from engine.inference.cup_disc import vertical_cup_to_disc

    return vertical_cup_to_disc(labels, names)


def export_mask(study: Study, labels: LabelMap, out_path: Path, provenance: Provenance | None = None) -> Path:
    """Write a mask as NIfTI, PNG or DICOM SEG (by suffix) with its provenance; see ``engine.io.export``."""
    return _export_mask(study, labels, Path(out_path), provenance)


def read_provenance(path: Path) -> Provenance:
    """The provenance record of a mask FedSM exported (or of its ``.provenance.json`` sidecar)."""
    return _read_provenance(Path(path))


def benchmark(preset: str, out_dir: Path, *, fresh: bool = False, device: str = "auto", threads: int = 1,
              docs_dir: Path | None = None, command: str | None = None, progress: ProgressFn | None = None,
              cancel: Callable[[], bool] | None = None, **reduce: Any) -> dict[str, Any]:
    """Run or resume ``fedsm bench`` (see :func:`engine.bench.runner.run_benchmark`); return its summary.

    ``reduce`` (``tasks``, ``seeds``, ``methods``, ``main_only``, ``no_analyses``, ``rules_only``) runs a
    reduced version of the preset.
    """
    from engine.bench.runner import run_benchmark

    return run_benchmark(preset, Path(out_dir), fresh=fresh, device=device, threads=threads, docs_dir=docs_dir,
                         command=command, progress=progress, cancel=cancel, **reduce)


def describe_device(device: str = "auto") -> dict[str, Any]:
    """Which device inference would use and why, e.g. ``{"device": "cpu", "reason": "CUDA not available: ..."}``."""
    from engine.device import describe_device as describe

    return describe(device)


def site_command(config: Path, json_events: bool = True, confirm_runs: bool = False) -> list[str]:
    """The command line that runs one federation site (``fedsm site``), e.g. for ``QProcess``.

    The site runs as its own process because Flower's SuperNode installs signal handlers; with
    ``json_events`` its stdout is one JSON event per line (see ``engine.federation.events``).
    With ``confirm_runs`` the site waits, before training for a new run, for
    :data:`RUN_ACCEPT` (or :data:`RUN_DECLINE`) on its standard input
    (:mod:`engine.security.run_review`).
    """
    argv = [sys.executable, "-m", "engine.cli.main", "site", "--config", str(Path(config))]
    argv += ["--json"] if json_events else []
    return [*argv, "--confirm-runs"] if confirm_runs else argv


#: Lines a ``confirm_runs`` site reads on its standard input.
RUN_ACCEPT, RUN_DECLINE = "accept", "decline"


def review_run_settings(settings: dict[str, Any], bounds: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{"setting", "value", "bound", "ok"}``: a ``run_settings`` event's settings against the site's bounds."""
    return review_rows(settings, bounds)


def read_site_config(path: Path) -> dict[str, Any]:
    """A checked ``site.toml`` as plain values (name, coordinator, datalist, approved_apps, ...).

    Raises :class:`ConfigError` naming the file and the key when something is wrong or missing.
    """
    from engine.federation.config import load_site_config

    return load_site_config(Path(path)).to_dict()


def app_hash() -> str:
    """``sha256:...`` of the FedSM app this installation runs: what a site pins in ``approved_apps``."""
    return build_app_bundle().hash


def format_run_settings(settings: dict[str, Any]) -> str:
    """One line an operator reads before training starts: the run's settings from a ``run_settings`` event.

    ``settings`` is the event's ``settings`` (what the coordinator signed and this site checked
    against the ``[bounds]`` of its site.toml; see ``engine.security.run_spec``).
    """
    return format_settings(settings)
