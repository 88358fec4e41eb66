"""The embedded demo: prepare (train once, then cached), open the demo study, segment it."""

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


class DemoController:
    """Runs ``engine.api.prepare_demo`` in a worker with a progress bar, then shows the demo:
    the demo photo with the super model's mask (and the ground truth to compare), and the
    federation panel pointed at the simulated demo site."""

    def __init__(self, main: MainView, tasks: TaskRunner, api: ModuleType | Any, studies: StudyController,
                 segmentation: SegmentationController, federation: FederationController) -> None:
        self.main = main
        self.tasks = tasks
        self.api = api
        self.studies = studies
        self.segmentation = segmentation
        self.federation = federation
        self.paths: dict[str, Any] | None = None
        self.validation = ""
        self.job: TaskHandle | None = None

    def start(self, cache_dir: Path, on_ready: Callable[[], None] | None = None, **settings: Any) -> None:
        """Prepare the demo in ``cache_dir`` and open it; ``on_ready`` runs once the overlay is shown."""
        self.main.set_busy("Preparing the demo …")

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> dict[str, Any]:
            return self.api.prepare_demo(cache_dir, progress, cancel, **settings)

        self.job = self.tasks.submit(job, on_done=lambda paths: self._open(paths, on_ready),
                                     on_error=self._failed, on_progress=self._progress)

    def cancel(self) -> None:
        """Stop preparing the demo."""
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def _progress(self, event: dict[str, Any]) -> None:
        if event.get("event") == "progress":
            self.main.set_busy(event.get("message") or "Preparing the demo …", int(event.get("done", 0)),
                               int(event.get("total", 0)))

    def _failed(self, exc: BaseException) -> None:
        self.main.set_busy(None)
        if is_cancelled(exc):
            self.main.show_status("Demo cancelled")
            return
        self.main.show_error("The demo could not be prepared", user_message(exc))

    def _open(self, paths: dict[str, Any], on_ready: Callable[[], None] | None) -> None:
        self.main.set_busy(None)
        self.paths = paths
        self.federation.demo_workdir = Path(paths["site_workdir"])
        if paths.get("trained"):
            self.main.show_status(f"Demo super model trained and cached in {paths['cache_dir']}")
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
