"""The desktop app's embedded demo: synthetic sites, a demo super model and a demo study, cached.

On first use :func:`prepare_demo` trains a small FedSM super model with a short in-process
federation of synthetic fundus sites (:func:`engine.simulate.run_simulation`, the same code as
``fedsm simulate``), then renders a demo photo from one site's acquisition profile at a higher
resolution with its ground-truth label map. Everything is written under ``cache_dir``; the
manifest ``demo.json`` is written last, so an interrupted preparation is never mistaken for a
finished one and simply starts again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]
MANIFEST = "demo.json"
#: Bumped when what the demo contains changes, so old caches are rebuilt.
DEMO_VERSION = 3
#: Random stream tag of the demo study: apart from every case the generator writes.
_DEMO_STREAM = 99
#: Validation Dice the demo super model should reach at every site (cleaned masks), so that what
#: the demo shows a clinician is a credible segmentation rather than a disc-sized cup.
TARGET_DICE = {"disc": 0.85, "cup": 0.6}


@dataclass(frozen=True)
class DemoSettings:
    """How the demo super model is trained and the demo study rendered.

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
    study_site: int = 2
    study_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.task != "fundus":
            raise ConfigError(f"the demo is a fundus federation; task {self.task!r} is not offered")
        if not 1 <= self.study_site <= self.sites:
            raise ConfigError(f"study_site must be one of the {self.sites} sites, got {self.study_site}")


def _file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cached(cache_dir: Path, settings: DemoSettings) -> dict[str, Any] | None:
    """The manifest of a complete earlier preparation with the same settings, else ``None``."""
    try:
        manifest = json.loads((cache_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if manifest.get("version") != DEMO_VERSION or manifest.get("settings") != asdict(settings):
        return None
    paths = _paths(cache_dir, manifest)
    if not all(Path(paths[k]).is_file() for k in ("bundle", "study", "reference")):
        return None
    if _file_sha256(Path(paths["bundle"])) != manifest.get("bundle_sha256"):
        log.warning("demo super model in %s does not match its manifest; training it again", cache_dir)
        return None
    return paths


def _paths(cache_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: str(cache_dir / v) for k, v in manifest["files"].items()}
    out["cache_dir"] = str(cache_dir)
    out["site_workdir"] = str(cache_dir / "site")
    out["bundle_sha256"] = manifest["bundle_sha256"]
    out["validation_dice"] = manifest.get("validation_dice", {})
    out["trained"] = False
    return out


def _demo_sites(data_dir: Path, cfg: DemoSettings) -> list[Path]:
    """The demo's synthetic sites' datalists: reused when complete and matching, else written."""
    from engine.data.synth import existing_federation, generate_federation

    found = existing_federation(data_dir, cfg.task, cfg.sites, cfg.image_size, cfg.seed, cases_scale=cfg.cases_scale)
    if found is not None:
        return found
    return generate_federation(cfg.task, cfg.sites, data_dir, image_size=cfg.image_size, seed=cfg.seed,
                               cases_scale=cfg.cases_scale)


def _render_study(cache_dir: Path, settings: DemoSettings) -> tuple[Path, Path]:
    """Write the demo photo and its ground-truth label map; return their paths."""
    import numpy as np

    from engine.data.synth import render_fundus, site_profiles
    from engine.io.files import write_label_png, write_rgb_png

    profile = site_profiles(settings.task, settings.sites)[settings.study_site - 1]
    rng = np.random.default_rng([settings.seed, settings.study_site - 1, _DEMO_STREAM, 0])
    image, label, _ = render_fundus(rng, profile, settings.study_size)
    study = cache_dir / "study" / f"demo_fundus_site{settings.study_site}.png"
    reference = cache_dir / "study" / f"demo_fundus_site{settings.study_site}_mask.png"
    write_rgb_png(study, image)
    write_label_png(reference, label)
    return study, reference


def validation_dice(bundle_path: Path, datalists: list[Path], image_size: int) -> dict[str, dict[str, float]]:
    """Disc and cup Dice of the routed super model on each site's validation cases (mean over cases).

    The masks are cleaned as the app shows them (:func:`engine.inference.postprocess.clean_fundus_masks`).
    """
    import numpy as np

    from engine.bundle import load_bundle
    from engine.data.site_data import load_site
    from engine.fl.evaluation import dice_per_case
    from engine.inference.postprocess import clean_fundus_masks
    from engine.inference.predictor import SuperModelPredictor
    from engine.tasks import get_task

    task = get_task("fundus")
    predictor = SuperModelPredictor(load_bundle(bundle_path), device="auto")
    out: dict[str, dict[str, float]] = {}
    for datalist in datalists:
        site = load_site(datalist, task, image_size)
        if not len(site.validation.images):
            continue
        masks = predictor.predict(site.validation.images).masks
        cleaned = np.stack([clean_fundus_masks(m) for m in masks])
        dice = dice_per_case(cleaned, site.validation.masks, site.validation.case_ids).mean(axis=0)
        out[site.name] = {name: float(d) for name, d in zip(task.label_names, dice, strict=True)}
    return out


def progress_message(round_: int, rounds: int) -> str:
    """What the progress bar says during round ``round_`` of a demo trained for ``rounds`` rounds.

    FedSM runs one more round after the training rounds, in which the sites only calibrate the
    model selector; it is not counted as a training round.
    """
    if round_ > rounds:
        return "Calibrating the model selector"
    return f"Training the demo super model: round {round_} of {rounds}"


def prepare_demo(cache_dir: Path, progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
                 **settings: Any) -> dict[str, Any]:
    """Return the demo's files, training the demo super model first when not cached.

    Parameters
    ----------
    cache_dir
        Where the demo lives (e.g. ``~/.cache/fedsm/demo``).
    progress
        Receives ``{"event": "progress", "done", "total", "message"}`` while training (and the
        simulation's own events).
    cancel
        Checked every batch; cancelling raises :class:`~engine.errors.CancelledError` and leaves
        no manifest behind.
    settings
        :class:`DemoSettings` fields (tests use tiny ones).

    Returns
    -------
    dict
        ``bundle`` (super model), ``study`` (demo photo), ``reference`` (its ground-truth mask),
        ``validation_dice`` (per site, disc and cup, on the sites' validation cases),
        ``data_dir`` (the synthetic sites), ``site_workdir`` (for the demo site process),
        ``cache_dir``, ``bundle_sha256`` and ``trained`` (True when trained by this call).
    """
    from engine.io.atomic import write_text_atomic
    from engine.simulate import SimulationConfig, run_simulation

    cfg = DemoSettings(**settings)
    cache_dir = Path(cache_dir).expanduser().absolute()
    found = _cached(cache_dir, cfg)
    if found is not None:
        return found
    (cache_dir / MANIFEST).unlink(missing_ok=True)
    from engine.threads import use_free_cores

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
                           datalists=tuple(str(p) for p in datalists))
    report = run_simulation(sim, cache_dir / "training", relay, cancel)
    bundle = cache_dir / "training" / report["supermodel"]["fedsm"]["path"]
    if progress:
        progress({"event": "progress", "done": 0, "total": 0, "message": "Validating the demo super model …"})
    per_structure = validation_dice(bundle, datalists, cfg.image_size)
    worst = {name: min(site[name] for site in per_structure.values()) for name in TARGET_DICE}
    if any(worst[name] < TARGET_DICE[name] for name in TARGET_DICE):
        log.warning("the demo super model's validation Dice (worst site: %s) is below the target %s",
                    {k: round(v, 3) for k, v in worst.items()}, TARGET_DICE)
    study, reference = _render_study(cache_dir, cfg)
    manifest = {
        "version": DEMO_VERSION,
        "settings": asdict(cfg),
        "files": {"bundle": str(bundle.relative_to(cache_dir)), "study": str(study.relative_to(cache_dir)),
                  "reference": str(reference.relative_to(cache_dir)), "data_dir": "data",
                  "report": str((cache_dir / "training" / "report.json").relative_to(cache_dir))},
        "bundle_sha256": report["supermodel"]["fedsm"]["sha256"],
        "validation_dice": per_structure,
        "validation_dice_worst_site": worst,
        "meets_target": all(worst[name] >= TARGET_DICE[name] for name in TARGET_DICE),
        "torch_threads": threads,
    }
    write_text_atomic(cache_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    out = _paths(cache_dir, manifest)
    out["trained"] = True
    if progress:
        progress({"event": "progress", "done": 1000, "total": 1000, "message": "Demo super model ready"})
    return out
