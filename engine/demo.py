"""The desktop app's embedded demo: a shipped demo super model and photo, retrainable, cached.

The repository ships a small trained demo (``resources/fedsm_demo``, installed as the package
data of ``fedsm_demo``): a FedSM super model trained with :class:`DemoSettings` on synthetic fundus
sites, a demo photo the federation recognises and the photo's ground truth. :func:`prepare_demo`
returns it at once, so the app shows the demo without training anything.

Training stays available (:func:`prepare_demo` with ``retrain=True``, the app's *Retrain the demo*
action): it writes the synthetic sites, trains the super model with a short in-process federation
(:func:`engine.simulate.run_simulation`, the same code as ``fedsm simulate``), measures its
validation Dice and chooses the demo photo, all under ``cache_dir``; the manifest ``demo.json`` is
written last, so an interrupted preparation is never mistaken for a finished one. A retrained demo
in ``cache_dir`` is used before the shipped one. :func:`build_shipped_demo` (run by
``benchmarks/build_demo_bundle.py``) trains the same way and writes the shipped files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from engine.bundle import SuperModelBundle, file_sha256, load_bundle, save_bundle
from engine.bundle.supermodel import DEFAULT_PERSONALIZATION, DEFAULT_SELECTOR_WIDTH
from engine.data.synth import existing_federation, generate_federation, render_fundus, site_profiles
from engine.errors import ConfigError
from engine.io.atomic import write_text_atomic
from engine.io.files import write_label_png, write_rgb_png
from engine.tasks import get_task
from engine.threads import use_free_cores

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]
MANIFEST = "demo.json"
#: Bumped when what the demo contains changes, so old caches are rebuilt.
DEMO_VERSION = 5
#: The package whose data is the shipped demo (the repository's ``resources/fedsm_demo``).
SHIPPED_PACKAGE = "fedsm_demo"
#: The command that writes the shipped demo (named in docs/gui.md#demo and in its manifest).
BUILD_COMMAND = "python benchmarks/build_demo_bundle.py"
#: File names of the shipped demo inside :data:`SHIPPED_PACKAGE`.
SHIPPED_BUNDLE = "demo_fundus.safetensors"
#: Random stream tag of the demo study: apart from every case the generator writes.
_DEMO_STREAM = 99
#: Candidate demo photos drawn (in this order) when choosing one the federation recognises.
STUDY_CANDIDATES = 8
#: Validation Dice the demo super model should reach at every site (cleaned masks), so that what
#: the demo shows a clinician is a credible segmentation rather than a disc-sized cup.
TARGET_DICE = {"disc": 0.85, "cup": 0.6}


@dataclass(frozen=True)
class DemoSettings:
    """How the demo super model is trained and the demo photo drawn.

    The defaults (four times the synthetic cases of the paper-like site table, 10 rounds of 8
    local epochs at lr 3e-3) train in about 150 CPU seconds; measured validation Dice and time in
    ``docs/gui.md#demo``. The project's general default lr (1e-3) leaves the cup channel marking
    the whole disc within this budget.
    """

    task: str = "fundus"
    sites: int = 3
    rounds: int = 10
    image_size: int = 64
    epochs: int = 8
    batch_size: int = 4
    #: Each synthetic site holds this many times its profile's cases (:mod:`engine.data.synth`).
    cases_scale: int = 4
    loss: str = "dice"
    lr: float = 3e-3
    lr_schedule: str = "constant"
    #: The site whose acquisition profile draws the demo photo. With the default personalization
    #: (APFL), site 2's personalized model beats the global one on its validation data by far more
    #: than the noise (Dice 0.896 vs 0.780 over 12 cases), so the routing guard lets its photos
    #: through: the demo shows FedSM routing a photo to its own site's model (site 1's model lost to
    #: the global one, site 3's led inside the noise; their photos go to global). Measured values in
    #: docs/gui.md#demo; choose the site again whenever the demo is rebuilt with other defaults.
    study_site: int = 2
    #: Side of every synthetic photo, the sites' and the demo's: the networks see them all resized
    #: to ``image_size`` the same way, so the demo photo has the statistics of its site's photos
    #: (a photo drawn larger than the sites' looks, once resized, unlike every site to the style gate).
    photo_size: int = 256
    seed: int = 0
    #: FedSM's personalization rule and the selector's width: the product's defaults, so that the
    #: demo a user sees first is the super model ``fedsm simulate`` and a federation train by
    #: default. A change of either default changes these settings, which no longer match the
    #: shipped manifest (``tests/test_demo_shipped.py`` then fails until the demo is rebuilt).
    personalization: str = DEFAULT_PERSONALIZATION
    selector_width: int = DEFAULT_SELECTOR_WIDTH

    def __post_init__(self) -> None:
        if self.task != "fundus":
            raise ConfigError(f"the demo is a fundus federation; task {self.task!r} is not offered")
        if not 1 <= self.study_site <= self.sites:
            raise ConfigError(f"study_site must be one of the {self.sites} sites, got {self.study_site}")
        if self.photo_size < self.image_size:
            raise ConfigError(f"photo_size ({self.photo_size}) must be at least image_size ({self.image_size})")


def _read_manifest(folder: Path, settings: DemoSettings, files: tuple[str, ...]) -> dict[str, Any] | None:
    """``folder``'s manifest when it describes a complete demo with these settings, else ``None``."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != DEMO_VERSION \
            or manifest.get("settings") != asdict(settings):
        return None
    names = manifest.get("files")
    if not isinstance(names, dict) or not all(isinstance(names.get(k), str) and (folder / names[k]).is_file()
                                               for k in files):
        return None
    if file_sha256(folder / names["bundle"]) != manifest.get("bundle_sha256"):
        log.warning("demo super model in %s does not match its manifest; not using it", folder)
        return None
    return manifest


def _cached(cache_dir: Path, settings: DemoSettings) -> dict[str, Any] | None:
    """The files of a complete earlier (re)training with the same settings, else ``None``."""
    manifest = _read_manifest(cache_dir, settings, ("bundle", "study", "reference"))
    return None if manifest is None else _paths(cache_dir, cache_dir, manifest, "cache")


def shipped_demo_dir() -> Path | None:
    """Folder of the shipped demo: the installed ``fedsm_demo`` package's, else the source tree's.

    The second place serves a checkout run without installing and an editable install made
    before the package existed (``resources/fedsm_demo`` beside ``engine/``).
    """
    try:
        root = resources.files(SHIPPED_PACKAGE)
    except ModuleNotFoundError:
        root = None
    if isinstance(root, Path) and (root / MANIFEST).is_file():
        return root
    source = Path(__file__).resolve().parents[1] / "resources" / SHIPPED_PACKAGE
    return source if (source / MANIFEST).is_file() else None


def shipped_demo(cache_dir: Path, settings: DemoSettings | None = None) -> dict[str, Any] | None:
    """The shipped demo's files when it was trained with ``settings`` (default: the defaults), else ``None``.

    ``cache_dir`` is where the demo site's working folder goes; the shipped files are read in place.
    """
    cfg = settings or DemoSettings()
    folder = shipped_demo_dir()
    if folder is None:
        return None
    manifest = _read_manifest(folder, cfg, ("bundle", "study", "reference"))
    return None if manifest is None else _paths(folder, Path(cache_dir), manifest, "shipped")


def _paths(root: Path, cache_dir: Path, manifest: dict[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {k: str(root / v) for k, v in manifest["files"].items()}
    out.setdefault("data_dir", None)
    out["cache_dir"] = str(cache_dir)
    out["site_workdir"] = str(cache_dir / "site")
    out["bundle_sha256"] = manifest["bundle_sha256"]
    out["validation_dice"] = manifest.get("validation_dice", {})
    out["study_routing"] = manifest.get("study_routing", {})
    out["source"] = source
    out["trained"] = source == "trained"
    return out


def _demo_sites(data_dir: Path, cfg: DemoSettings) -> list[Path]:
    """The demo's synthetic sites' datalists: reused when complete and matching, else written."""
    found = existing_federation(data_dir, cfg.task, cfg.sites, cfg.photo_size, cfg.seed, cases_scale=cfg.cases_scale)
    if found is not None:
        return found
    return generate_federation(cfg.task, cfg.sites, data_dir, image_size=cfg.photo_size, seed=cfg.seed,
                               cases_scale=cfg.cases_scale)


def _study_rank(routed: str, own_site: str, unlike: bool) -> int:
    """Preference of a candidate photo: 0 routed to its own site's model, 1 to global for a
    reason other than the style gate, 2 routed to another site's model, 3 found unlike every site."""
    if unlike:
        return 3
    if routed == own_site:
        return 0
    return 1 if routed == "global" else 2


def choose_study(bundle_path: Path, out_dir: Path, settings: DemoSettings) -> tuple[Path, Path, dict[str, Any]]:
    """Draw candidate demo photos from the study site's acquisition profile and keep the first the
    super model routes best (:func:`_study_rank`: to the site's own model if any candidate goes there).

    The photo and its ground-truth label map are written under ``out_dir``; the returned dict
    records the chosen candidate and how the super model routed it (``case``, ``model``,
    ``confidence``, ``reason``, ``unlike_sites``).
    """
    from engine.data.preprocess import normalise_rgb
    from engine.inference.study import load_predictor

    predictor = load_predictor(bundle_path, "auto").predictor
    site_names = list(predictor.metadata.site_names)
    own = site_names[settings.study_site - 1]
    profile = site_profiles(settings.task, settings.sites)[settings.study_site - 1]
    best: tuple[int, int, np.ndarray, np.ndarray, dict[str, Any]] | None = None
    for case in range(STUDY_CANDIDATES):
        rng = np.random.default_rng([settings.seed, settings.study_site - 1, _DEMO_STREAM, case])
        image, label, _ = render_fundus(rng, profile, settings.photo_size)
        pred = predictor.predict(normalise_rgb(image)[None])
        unlike = bool(pred.unlike_sites[0]) if len(pred.unlike_sites) else False
        routed = pred.routed_names(site_names)[0]
        rank = _study_rank(routed, own, unlike)
        if best is None or rank < best[0]:
            record = {"case": case, "model": routed, "confidence": round(float(pred.confidence[0]), 4),
                      "reason": pred.reasons[0] if len(pred.reasons) else "", "unlike_sites": unlike}
            best = (rank, case, image, label, record)
        if rank == 0:
            break
    assert best is not None
    rank, _, image, label, record = best
    if rank == 3:
        log.warning("no demo photo of %s's profile lies inside the style gate; showing one it finds unlike", own)
    study = out_dir / f"demo_fundus_{own}.png"
    reference = out_dir / f"demo_fundus_{own}_mask.png"
    write_rgb_png(study, image)
    write_label_png(reference, label)
    return study, reference, record


def validation_dice(bundle_path: Path, datalists: list[Path], image_size: int) -> dict[str, dict[str, float]]:
    """Disc and cup Dice of the routed super model on each site's validation cases (mean over cases).

    The masks are cleaned as the app shows them (:func:`engine.inference.postprocess.clean_fundus_masks`).
    """
    from engine.data.site_data import load_site
    from engine.fl.evaluation import dice_per_case
    from engine.inference.postprocess import clean_fundus_masks
    from engine.inference.predictor import SuperModelPredictor

    task = get_task("fundus")
    predictor = SuperModelPredictor(load_bundle(bundle_path), device="auto")
    out: dict[str, dict[str, float]] = {}
    for datalist in datalists:
        site = load_site(datalist, task, image_size)
        if not len(site.validation.images):
            continue
        masks = predictor.predict(site.validation.images, cases=site.validation.case_ids).masks
        cleaned = np.stack([clean_fundus_masks(m) for m in masks])
        dice = dice_per_case(cleaned, site.validation.masks, site.validation.case_ids).mean(axis=0)
        out[site.name] = {name: float(d) for name, d in zip(task.label_names, dice, strict=True)}
    return out


def _quality(per_structure: dict[str, dict[str, float]]) -> dict[str, Any]:
    worst = {name: min(site[name] for site in per_structure.values()) for name in TARGET_DICE}
    if any(worst[name] < TARGET_DICE[name] for name in TARGET_DICE):
        log.warning("the demo super model's validation Dice (worst site: %s) is below the target %s",
                    {k: round(v, 3) for k, v in worst.items()}, TARGET_DICE)
    return {"validation_dice": per_structure, "validation_dice_worst_site": worst,
            "meets_target": all(worst[name] >= TARGET_DICE[name] for name in TARGET_DICE)}


def progress_message(round_: int, rounds: int) -> str:
    """What the progress bar says during round ``round_`` of a demo trained for ``rounds`` rounds.

    FedSM runs one more round after the training rounds, in which the sites only calibrate the
    model selector; it is not counted as a training round.
    """
    if round_ > rounds:
        return "Calibrating the model selector"
    return f"Training the demo super model: round {round_} of {rounds}"


def prepare_demo(cache_dir: Path, progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
                 *, retrain: bool = False, **settings: Any) -> dict[str, Any]:
    """Return the demo's files: a retrained demo cached in ``cache_dir``, else the shipped one, else
    (or with ``retrain``) a demo super model trained now and cached.

    Parameters
    ----------
    cache_dir
        Where a (re)trained demo lives (e.g. ``~/.cache/fedsm/demo``) and the demo site's working folder.
    progress
        Receives ``{"event": "progress", "done", "total", "message"}`` while training (and the
        simulation's own events).
    cancel
        Checked every batch; cancelling raises :class:`~engine.errors.CancelledError` and leaves
        no manifest behind (the next start uses the shipped demo).
    retrain
        Train even when a cached or shipped demo exists (the app's *Retrain the demo*).
    settings
        :class:`DemoSettings` fields (tests use tiny ones; only the defaults are shipped).

    Returns
    -------
    dict
        ``bundle`` (super model), ``study`` (demo photo), ``reference`` (its ground-truth mask),
        ``validation_dice`` (per site, disc and cup, on the sites' validation cases),
        ``study_routing`` (how the super model routed the photo when it was chosen),
        ``data_dir`` (the synthetic sites; ``None`` for the shipped demo), ``site_workdir`` (for the
        demo site process), ``cache_dir``, ``bundle_sha256``, ``source`` (``"shipped"``, ``"cache"``
        or ``"trained"``) and ``trained`` (True when trained by this call).
    """
    cfg = DemoSettings(**settings)
    cache_dir = Path(cache_dir).expanduser().absolute()
    if not retrain:
        found = _cached(cache_dir, cfg) or shipped_demo(cache_dir, cfg)
        if found is not None:
            return found
    return _train(cache_dir, cfg, progress, cancel)


def _train(cache_dir: Path, cfg: DemoSettings, progress: ProgressFn | None,
           cancel: Callable[[], bool] | None) -> dict[str, Any]:
    from engine.simulate import SimulationConfig, run_simulation

    (cache_dir / MANIFEST).unlink(missing_ok=True)
    threads = use_free_cores()
    total_rounds = cfg.rounds + 1  # FedSM adds one validation and calibration round after the training rounds
    site_names = [f"site{k + 1}" for k in range(cfg.sites)]

    def relay(event: dict[str, Any]) -> None:
        if progress is None:
            return
        progress(event)
        kind = event.get("event")
        if kind == "batch" and event.get("site") in site_names and event.get("batches"):
            k = site_names.index(event["site"])
            within = (k + event["batch"] / event["batches"]) / len(site_names)
            done = int(1000 * (event["round"] - 1 + within) / total_rounds)
            progress({"event": "progress", "done": done, "total": 1000,
                      "message": progress_message(event["round"], cfg.rounds)})
        elif kind == "status":
            progress({"event": "progress", "done": 0, "total": 0, "message": event.get("message", "")})

    if progress:
        progress({"event": "progress", "done": 0, "total": 0, "message": "Writing synthetic fundus sites …"})
    datalists = _demo_sites(cache_dir / "data", cfg)
    sim = SimulationConfig(task=cfg.task, sites=cfg.sites, rounds=cfg.rounds, methods=("fedsm",),
                           image_size=cfg.image_size, epochs=cfg.epochs, batch_size=cfg.batch_size, seed=cfg.seed,
                           loss=cfg.loss, lr=cfg.lr, lr_schedule=cfg.lr_schedule, device="auto",
                           personalization=cfg.personalization, selector_width=cfg.selector_width,
                           datalists=tuple(str(p) for p in datalists))
    report = run_simulation(sim, cache_dir / "training", relay, cancel)
    bundle = cache_dir / "training" / report["supermodel"]["fedsm"]["path"]
    if progress:
        progress({"event": "progress", "done": 0, "total": 0, "message": "Validating the demo super model …"})
    quality = _quality(validation_dice(bundle, datalists, cfg.image_size))
    study, reference, routing = choose_study(bundle, cache_dir / "study", cfg)
    manifest = {
        "version": DEMO_VERSION,
        "settings": asdict(cfg),
        "files": {"bundle": str(bundle.relative_to(cache_dir)), "study": str(study.relative_to(cache_dir)),
                  "reference": str(reference.relative_to(cache_dir)), "data_dir": "data",
                  "report": str((cache_dir / "training" / "report.json").relative_to(cache_dir))},
        "bundle_sha256": report["supermodel"]["fedsm"]["sha256"],
        **quality,
        "study_routing": routing,
        "torch_threads": threads,
    }
    write_text_atomic(cache_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    out = _paths(cache_dir, cache_dir, manifest, "trained")
    if progress:
        progress({"event": "progress", "done": 1000, "total": 1000, "message": "Demo super model ready"})
    return out


def half_precision_bundle(source: Path, target: Path, note: dict[str, Any]) -> str:
    """Write ``source``'s super model to ``target`` with its floating-point tensors in float16.

    The networks load them into float32 parameters (``load_state_dict`` converts), so the bundle
    is a normal one at half the size. ``note`` is recorded in the metadata's ``extra["demo"]``.
    Returns the written file's SHA-256.
    """
    full = load_bundle(source)

    def half(weights: dict[str, Any]) -> dict[str, Any]:
        return {k: t.half() if t.is_floating_point() else t for k, t in weights.items()}

    meta = dataclasses.replace(full.metadata, extra={**full.metadata.extra, "demo": note})
    return save_bundle(target, SuperModelBundle(meta, half(full.global_weights),
                                                {s: half(w) for s, w in full.personal_weights.items()},
                                                half(full.selector_weights)))


def build_shipped_demo(out_dir: Path, work_dir: Path, progress: ProgressFn | None = None,
                       cancel: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Train the demo with the default :class:`DemoSettings` in ``work_dir`` and write the shipped
    demo into ``out_dir`` (the repository's ``resources/fedsm_demo``; ``benchmarks/build_demo_bundle.py``).

    The super model is stored in float16 (:func:`half_precision_bundle`); its validation Dice and
    the demo photo's routing are measured again on that file. The manifest is written last.
    Returns the manifest.
    """
    cfg = DemoSettings()
    out_dir, work_dir = Path(out_dir).absolute(), Path(work_dir).absolute()
    trained = prepare_demo(work_dir, progress, cancel, retrain=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    sha = half_precision_bundle(Path(trained["bundle"]), out_dir / SHIPPED_BUNDLE,
                                {"weights": "float16", "built_by": BUILD_COMMAND, "settings": asdict(cfg)})
    quality = _quality(validation_dice(out_dir / SHIPPED_BUNDLE, _demo_sites(work_dir / "data", cfg), cfg.image_size))
    study, reference, routing = choose_study(out_dir / SHIPPED_BUNDLE, out_dir, cfg)
    manifest = {
        "version": DEMO_VERSION,
        "settings": asdict(cfg),
        "files": {"bundle": SHIPPED_BUNDLE, "study": study.name, "reference": reference.name},
        "bundle_sha256": sha,
        "bundle_bytes": (out_dir / SHIPPED_BUNDLE).stat().st_size,
        "weights": "float16",
        **quality,
        "study_routing": routing,
        "built_by": BUILD_COMMAND,
    }
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
