"""Opening studies and masks: series choice, worker threads, errors, recent files."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.errors import DataError
from engine.io.study import LabelMap, Study
from fedsm_gui.controllers.errors import is_cancelled, user_message
from fedsm_gui.controllers.runners import TaskHandle, TaskRunner
from fedsm_gui.models.display import Slicer
from fedsm_gui.models.overlay import REFERENCE_LAYER, OverlayState
from fedsm_gui.models.recent import RecentFiles
from fedsm_gui.models.viewer import ViewerState, WindowDefaults, window_defaults
from fedsm_gui.views.bases import MainView

log = logging.getLogger(__name__)


def progress_pair(event: dict[str, Any]) -> tuple[int, int] | None:
    """``(done, total)`` from a progress event, whichever names the engine used."""
    for done_key, total_key in (("done", "total"), ("batch", "batches"), ("step", "steps"), ("index", "count")):
        if done_key in event and total_key in event:
            try:
                return int(event[done_key]), int(event[total_key])
            except (TypeError, ValueError):
                return None
    return None


class StudyController:
    """Opens files and folders off the GUI thread and puts the result on screen.

    Parameters
    ----------
    api
        The engine facade (:mod:`engine.api`); tests pass a fake with the same functions.
    """

    def __init__(self, viewer: ViewerState, overlays: OverlayState, main: MainView, tasks: TaskRunner,
                 recent: RecentFiles, api: ModuleType | Any) -> None:
        self.viewer = viewer
        self.overlays = overlays
        self.main = main
        self.tasks = tasks
        self.recent = recent
        self.api = api
        self.job: TaskHandle | None = None
        self.study_opened: list[Callable[[Study], None]] = []
        self.mask_opened: list[Callable[[LabelMap], None]] = []
        main.open_requested.connect(self.open_path)
        main.open_mask_requested.connect(self.open_mask)
        main.set_recent(recent.paths)

    # --- studies -------------------------------------------------------------------------
    def open_path(self, path: str | Path, then: Callable[[Study], None] | None = None) -> None:
        """Open a file or folder; a folder with several series asks which one first."""
        target = Path(path)
        if not target.exists():
            self.recent.remove(target)
            self.main.set_recent(self.recent.paths)
            self.main.show_error("Cannot open", f"{target}: no such file or folder; it may have been moved or deleted")
            return
        if target.is_dir():
            self.main.set_busy(f"Reading the series in {target.name} …")
            self.job = self.tasks.submit(lambda progress, cancel: self.api.list_series(target),
                                         on_done=lambda series: self._choose_series(target, series, then),
                                         on_error=lambda exc: self._failed("Cannot open", exc))
            return
        self._read(target, None, then)

    def _choose_series(self, path: Path, series: list[Any], then: Callable[[Study], None] | None) -> None:
        self.main.set_busy(None)
        if not series:
            self.main.show_error("Cannot open", f"{path}: no images found in this folder; choose a folder that "
                                                "holds DICOM files or an image file")
            return
        uid = series[0].uid
        if len(series) > 1:
            chosen = self.main.choose_series(series)
            if chosen is None:
                self.main.show_status("Opening cancelled")
                return
            uid = chosen
        self._read(path, uid, then)

    def _read(self, path: Path, series_uid: str | None, then: Callable[[Study], None] | None) -> None:
        self.main.set_busy(f"Opening {path.name} …")

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]
                ) -> tuple[Study, Slicer, WindowDefaults | None]:
            study = self.api.open_study(path, series_uid=series_uid, progress=progress, cancel=cancel)
            # Display copies and window percentiles, off the GUI thread.
            defaults = window_defaults(study) if study.kind == "volume" else None
            return study, Slicer(study.array, study.kind == "volume"), defaults

        self.job = self.tasks.submit(job, on_done=lambda result: self._opened(path, *result, then),
                                     on_error=lambda exc: self._failed("Cannot open", exc),
                                     on_progress=self._progress)

    def _progress(self, event: dict[str, Any]) -> None:
        pair = progress_pair(event)
        if pair is not None:
            self.main.set_busy(event.get("message") or "Opening …", *pair)

    def _opened(self, path: Path, study: Study, slicer: Slicer, defaults: WindowDefaults | None,
                then: Callable[[Study], None] | None) -> None:
        self.main.set_busy(None)
        self.show_study(study, slicer, defaults)
        self.recent.add(path)
        self.main.set_recent(self.recent.paths)
        if then is not None:
            then(study)

    def show_study(self, study: Study, slicer: Slicer | None = None, defaults: WindowDefaults | None = None) -> None:
        """Put ``study`` on screen (no file involved: tests and benchmarks use it directly)."""
        self.overlays.clear()
        self.viewer.set_study(study, slicer, defaults)
        name = study.source.name if study.source is not None else "study"
        self.main.set_title(f"{name} — {study.kind}, {' × '.join(map(str, study.shape))}"
                            + (f", {study.modality}" if study.modality else ""))
        self.main.show_status(f"Opened {name}")
        for callback in list(self.study_opened):
            callback(study)

    def _failed(self, title: str, exc: BaseException) -> None:
        self.main.set_busy(None)
        if is_cancelled(exc):
            self.main.show_status("Cancelled")
            return
        self.main.show_error(title, user_message(exc))

    # --- masks ---------------------------------------------------------------------------
    def open_mask(self, path: str | Path) -> None:
        """Load a mask to compare with the model's (shown as the reference layer)."""
        study = self.viewer.study
        if study is None:
            self.main.show_error("No study open", "open the image first, then the mask that belongs to it")
            return
        target = Path(path)
        self.main.set_busy(f"Opening mask {target.name} …")
        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> tuple[LabelMap, Slicer]:
            labels = self.api.open_mask(target, study, "auto")  # Drishti soft maps: one binarised map
            slicer = Slicer(labels.array, labels.array.ndim == 3)
            slicer.label_values()  # counted here, off the GUI thread
            return labels, slicer

        self.job = self.tasks.submit(job, on_done=lambda result: self._mask_opened(target, study, *result),
                                     on_error=lambda exc: self._failed("Cannot open the mask", exc))

    def _mask_opened(self, path: Path, study: Study, labels: LabelMap, slicer: Slicer) -> None:
        self.main.set_busy(None)
        if study is not self.viewer.study:
            return  # another study was opened meanwhile
        if tuple(labels.array.shape) != tuple(study.shape):
            self._failed("Cannot open the mask", DataError(
                f"{path}: mask shape {labels.array.shape} does not match the study {study.shape}; "
                "choose the mask made for this image"))
            return
        self.overlays.set_layer(REFERENCE_LAYER, labels, title=f"reference: {path.name}", slicer=slicer)
        self.main.show_status(f"Loaded mask {path.name}")
        for callback in list(self.mask_opened):
            callback(labels)
