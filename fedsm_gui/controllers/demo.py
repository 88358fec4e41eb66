"""The embedded demo: open the shipped (or a retrained, cached) demo study and segment it; retrain on request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fedsm_gui.controllers.errors import is_cancelled, user_message
from fedsm_gui.controllers.federation import FederationController
from fedsm_gui.controllers.runners import TaskHandle, TaskRunner
from fedsm_gui.controllers.segmentation import SegmentationController
from fedsm_gui.controllers.study import StudyController
from fedsm_gui.views.bases import MainView


def demo_validation_text(per_site: dict[str, dict[str, float]]) -> str:
    """One status line with the demo model's validation Dice at its weakest site (``""``: unknown)."""
    if not per_site:
        return ""
    worst = {name: min(site.get(name, 0.0) for site in per_site.values()) for name in ("disc", "cup")}
    return (f"Demo super model, validation Dice at the weakest of {len(per_site)} synthetic sites: "
            f"disc {worst['disc']:.2f}, cup {worst['cup']:.2f} (research model, not for diagnosis)")


def demo_source_text(paths: dict[str, Any]) -> str:
    """Status line saying which demo super model is shown (``""``: nothing to say)."""
    source = paths.get("source")
    if source == "trained":
        return f"Demo super model retrained and cached in {paths['cache_dir']}"
    if source == "cache":
        return f"Demo super model retrained earlier, from {paths['cache_dir']}"
    if source == "shipped":
        return "Demo super model shipped with FedSM (Demo ▸ Retrain the demo super model trains it again)"
    return ""


class DemoController:
    """Runs ``engine.api.prepare_demo`` in a worker, then shows the demo: the demo photo with the
    super model's mask (and the ground truth to compare), and the federation panel pointed at the
    simulated demo site. The shipped demo needs no training; :meth:`retrain` trains the demo super
    model again (progress in the busy bar, stopped by :meth:`cancel`) and caches it in ``cache_dir``.
    """

    def __init__(self, main: MainView, tasks: TaskRunner, api: ModuleType | Any, studies: StudyController,
                 segmentation: SegmentationController, federation: FederationController,
                 cache_dir: Path | None = None) -> None:
        self.main = main
        self.tasks = tasks
        self.api = api
        self.studies = studies
        self.segmentation = segmentation
        self.federation = federation
        self.cache_dir = cache_dir
        self.settings: dict[str, Any] = {}
        self.paths: dict[str, Any] | None = None
        self.validation = ""
        self.job: TaskHandle | None = None
        self.retraining = False
        main.retrain_demo_requested.connect(self.retrain)
        main.stop_demo_requested.connect(self.cancel)

    def start(self, cache_dir: Path, on_ready: Callable[[], None] | None = None, **settings: Any) -> None:
        """Open the demo (retrained in ``cache_dir`` earlier, else shipped, else trained now);
        ``on_ready`` runs once the overlay is shown."""
        self.cache_dir, self.settings = Path(cache_dir), dict(settings)
        self._prepare("Opening the demo …", False, on_ready)

    def retrain(self, on_ready: Callable[[], None] | None = None) -> None:
        """Train the demo super model again (the existing training path, in a worker) and show it.

        Ignored while the demo is being prepared or trained.
        """
        if self.job is not None and not self.job.done:
            self.main.show_status("The demo is already being prepared")
            return
        if self.cache_dir is None:
            self.main.show_error("Cannot retrain the demo", "no demo cache folder is set; start with  fedsm-gui --demo")
            return
        self._prepare("Retraining the demo super model …", True, on_ready)

    def cancel(self) -> None:
        """Stop preparing or retraining the demo (what was shown before stays)."""
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def _prepare(self, message: str, retrain: bool, on_ready: Callable[[], None] | None) -> None:
        cache_dir, settings = self.cache_dir, self.settings
        self.main.set_busy(message)
        self._set_retraining(retrain)

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> dict[str, Any]:
            if retrain:
                return self.api.prepare_demo(cache_dir, progress, cancel, retrain=True, **settings)
            return self.api.prepare_demo(cache_dir, progress, cancel, **settings)

        self.job = self.tasks.submit(job, on_done=lambda paths: self._open(paths, on_ready),
                                     on_error=self._failed, on_progress=self._progress)

    def _set_retraining(self, running: bool) -> None:
        self.retraining = running
        self.main.set_demo_retraining(running)

    def _progress(self, event: dict[str, Any]) -> None:
        if event.get("event") == "progress":
            self.main.set_busy(event.get("message") or "Preparing the demo …", int(event.get("done", 0)),
                               int(event.get("total", 0)))

    def _failed(self, exc: BaseException) -> None:
        retraining = self.retraining
        self.main.set_busy(None)
        self._set_retraining(False)
        if is_cancelled(exc):
            self.main.show_status("Demo retraining stopped; the demo model shown is unchanged" if retraining
                                  else "Demo cancelled")
            return
        self.main.show_error("The demo super model could not be retrained" if retraining
                             else "The demo could not be prepared", user_message(exc))

    def _open(self, paths: dict[str, Any], on_ready: Callable[[], None] | None) -> None:
        self.main.set_busy(None)
        self._set_retraining(False)
        self.paths = paths
        self.federation.demo_workdir = Path(paths["site_workdir"])
        source = demo_source_text(paths)
        if source:
            self.main.show_status(source)
        self.validation = demo_validation_text(paths.get("validation_dice") or {})

        def segmented() -> None:
            if self.validation:  # after the reference mask's own status line
                self.studies.mask_opened.append(self._once(lambda: self.main.show_status(self.validation)))
            if on_ready is not None:
                self.studies.mask_opened.append(self._once(on_ready))
            self.studies.open_mask(paths["reference"])

        self.studies.open_path(paths["study"], then=lambda study: self.segmentation.load_bundle(
            paths["bundle"], then=lambda: self.segmentation.run(then=segmented)))

    def _once(self, callback: Callable[[], None]) -> Callable[[Any], None]:
        def fire(_labels: Any) -> None:
            self.studies.mask_opened.remove(fire)
            callback()

        return fire
