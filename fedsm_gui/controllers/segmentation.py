"""The segmentation panel: bundle, gamma, device, Run/Cancel, routing per image or slice, compare, export."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.io.study import Study
from fedsm_gui.controllers.errors import is_cancelled, user_message
from fedsm_gui.controllers.runners import TaskHandle, TaskRunner
from fedsm_gui.controllers.study import progress_pair
from fedsm_gui.models.display import Slicer
from fedsm_gui.models.overlay import MODEL_LAYER, REFERENCE_LAYER, OverlayState
from fedsm_gui.models.segmentation import DONE, NO_MODEL, RUNNING, SegmentationState
from fedsm_gui.models.viewer import ViewerState
from fedsm_gui.views.bases import MainView, SegmentationView

log = logging.getLogger(__name__)

COMPARE_LAYER = "compare"
NO_MODEL_MESSAGE = ("No super model loaded.\nLoad a FedSM bundle (.safetensors) written by "
                    "'fedsm simulate' or a federation, or start with  fedsm-gui --demo.")


class SegmentationController:
    """Runs the super model on the open study in a worker and shows what the selector chose."""

    def __init__(self, state: SegmentationState, viewer: ViewerState, overlays: OverlayState,
                 view: SegmentationView, main: MainView, tasks: TaskRunner, api: ModuleType | Any) -> None:
        self.state = state
        self.viewer = viewer
        self.overlays = overlays
        self.view = view
        self.main = main
        self.tasks = tasks
        self.api = api
        self.job: TaskHandle | None = None
        self._result_study: Study | None = None
        self._compare_result: Any = None
        state.changed.connect(self.refresh)
        viewer.slices_changed.connect(self.show_current)
        viewer.study_changed.connect(self._study_changed)
        overlays.changed.connect(self._show_cup_to_disc)
        view.load_bundle_requested.connect(self.load_bundle)
        view.gamma_changed.connect(state.set_gamma)
        view.run_requested.connect(self.run)
        view.cancel_requested.connect(self.cancel)
        view.force_model_requested.connect(self.force_model)
        view.compare_requested.connect(self.compare)
        view.export_requested.connect(self.export)
        view.keep_names_changed.connect(self.set_keep_names)
        self._keep_names = False
        self._name_job: TaskHandle | None = None
        view.strip_slice_requested.connect(self.go_to_slice)
        self.refresh()
        # Which device will run the model, asked at start-up: it also imports torch in a worker
        # now, instead of stalling the first bundle load.
        self.tasks.submit(lambda progress, cancel: self.api.describe_device("auto"), on_done=state.set_device,
                          on_error=lambda exc: log.warning("cannot tell the inference device: %s", exc))

    # --- state -> view -------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw the panel from the state."""
        s = self.state
        self.view.set_metadata(str(s.bundle_path) if s.bundle_path else None, s.metadata,
                               s.message if s.status == NO_MODEL and s.message else NO_MODEL_MESSAGE)
        self.view.set_gamma(s.gamma, s.gamma_not_used)
        if s.device is not None:
            self.view.set_device(f"{s.device.get('device', '?')} — {s.device.get('reason', '')}".rstrip(" —"))
        if s.chooses_site:
            self.view.set_models(s.model_names, s.forced_model, choose_site=True)
        else:
            self.view.set_models(s.model_names, s.forced_model)
        self.view.set_photo(self.is_photo())
        can_run = s.metadata is not None and self.viewer.study is not None and s.status != RUNNING
        self.view.set_run_state(s.status, *s.progress, s.message, can_run)
        self.show_current()

    def is_photo(self) -> bool:
        """Whether the open study is a photo (one image) rather than a volume (slices)."""
        study = self.viewer.study
        return study is not None and study.kind == "photo"

    def current_index(self) -> int:
        """Index of the image/slice the routing values refer to (the axial slice of a volume)."""
        study = self.viewer.study
        if study is None or study.kind == "photo":
            return 0
        return self.viewer.cursor[2]

    def show_current(self) -> None:
        """Routing strip and the current slice's values."""
        names = self.state.result.model_names if self.state.result is not None else self.state.model_names
        strip = [(r.model, r.confidence) for r in self.state.routing]
        index = self.current_index()
        self.view.set_routing(strip, names, index)
        routing = self.state.routing_at(index)
        if routing is None:
            self.view.set_current(None, None, None, {}, None)
        else:
            self.view.set_current(routing.index, routing.model, routing.confidence, routing.probabilities,
                                  routing.runner_up, routing.reason)

    def _show_cup_to_disc(self) -> None:
        study = self.viewer.study
        if study is None or study.kind != "photo":
            self.view.set_cup_to_disc(None, None)
            return
        values = []
        for key in (MODEL_LAYER, REFERENCE_LAYER):
            layer = self.overlays.layers.get(key)
            values.append(self.api.cup_to_disc_ratio(layer.labels.array, layer.labels.names) if layer else None)
        self.view.set_cup_to_disc(*values)

    def _study_changed(self) -> None:
        self._propose_export_name()
        if self.job is not None and not self.job.done:
            self.job.cancel()
        self._result_study = None
        self._compare_result = None
        self.state.clear_result()
        self._show_cup_to_disc()

    # --- export name ---------------------------------------------------------------------
    def set_keep_names(self, keep: bool) -> None:
        """Whether the export dialog proposes the image file's own name (default: a neutral one)."""
        self._keep_names = bool(keep)
        self._propose_export_name()

    def _propose_export_name(self) -> None:
        """``<stem>_mask<suffix>`` for the export dialog; the neutral stem hashes the study's files in a worker."""
        study = self.viewer.study
        if study is None:
            return
        suffix = ".png" if study.kind == "photo" else (".dcm" if study.source_format == "dicom" else ".nii.gz")
        keep = self._keep_names
        self.view.set_export_name(f"mask{suffix}")  # until the name is known
        if self._name_job is not None and not self._name_job.done:
            self._name_job.cancel()

        def done(stem: str) -> None:
            if self.viewer.study is study and self._keep_names == keep:
                self.view.set_export_name(f"{stem}_mask{suffix}")

        self._name_job = self.tasks.submit(lambda progress, cancel: self.api.mask_file_stem(study, keep_names=keep),
                                           on_done=done,
                                           on_error=lambda exc: None if is_cancelled(exc)
                                           else log.warning("cannot name the mask: %s", exc))

    # --- bundle --------------------------------------------------------------------------
    def load_bundle(self, path: str | Path, then: Callable[[], None] | None = None) -> None:
        """Read a bundle's metadata and load its networks (so Run starts at once) in a worker."""
        target = Path(path)
        self.main.set_busy(f"Loading the super model {target.name} …")

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> tuple[dict, dict]:
            metadata = self.api.read_bundle_metadata(target)
            self.api.preload_super_model(target, "auto")
            return metadata, self.api.describe_device("auto")

        def done(result: tuple[dict, dict]) -> None:
            self.main.set_busy(None)
            metadata, device = result
            self.state.set_bundle(target, metadata)
            self.state.set_device(device)
            self.main.show_status(f"Loaded super model {target.name}")
            if then is not None:
                then()

        def failed(exc: BaseException) -> None:
            self.main.set_busy(None)
            self.main.show_error("Cannot load the super model", user_message(exc))

        self.tasks.submit(job, on_done=done, on_error=failed)

    def force_model(self, model: str) -> None:
        """Route every slice to ``model`` in the next run (``""``: let the selector choose).

        For a BlackFed bundle ``model`` is the site whose client net segments.
        """
        self.state.set_forced_model(model or None)

    # --- run -----------------------------------------------------------------------------
    def _segment(self, study: Study, force: str | None, on_done: Callable[[Any, Slicer], None]) -> None:
        bundle, gamma = self.state.bundle_path, self.state.gamma

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> tuple[Any, Slicer]:
            result = self.api.segment_study(bundle, study, gamma=gamma, device="auto", force_model=force,
                                            progress=lambda done, total: progress({"done": done, "total": total}),
                                            cancel=cancel)
            slicer = Slicer(result.labels.array, result.labels.array.ndim == 3)
            slicer.label_values()  # counted here, off the GUI thread
            return result, slicer

        self.state.start()
        self.job = self.tasks.submit(job, on_done=lambda done: on_done(*done), on_error=self._failed,
                                     on_progress=self._progress)

    def run(self, then: Callable[[], None] | None = None) -> None:
        """Segment the open study with the loaded super model."""
        study = self.viewer.study
        if self.state.metadata is None or study is None:
            self.main.show_error("Cannot run", "load a super model and open a study first"
                                 if study is None else NO_MODEL_MESSAGE.splitlines()[0])
            return
        if self.state.status == RUNNING:
            return

        def done(result: Any, slicer: Slicer) -> None:
            if study is not self.viewer.study:
                return
            self._result_study = study
            self.state.finish(result)
            if self.state.chooses_site:
                routed = f"client net of {self.state.forced_model}"
            else:
                routed = "forced: " + self.state.forced_model if self.state.forced_model else "routed"
            self.overlays.set_layer(MODEL_LAYER, result.labels, title=f"model ({routed})", outline=False,
                                    slicer=slicer)
            self.main.show_status(f"Segmented on {result.device}")
            if then is not None:
                then()

        self._segment(study, self.state.forced_model, done)

    def compare(self, model: str = "") -> None:
        """Segment with ``model`` (default: the current slice's runner-up) and show it as outlines."""
        study = self.viewer.study
        if study is None or self.state.metadata is None:
            return
        if not model:
            routing = self.state.routing_at(self.current_index())
            if routing is None or not routing.runner_up:
                where = "this image" if self.is_photo() else "this slice"
                self.main.show_error("Nothing to compare", "run the super model first; the runner-up is the "
                                                           f"model the selector ranked second for {where}")
                return
            model = routing.runner_up
        previous = self.state.result

        def done(result: Any, slicer: Slicer) -> None:
            # keep the routed result in the panel; the comparison only adds an overlay layer
            self.state.result = previous
            self.state.status = DONE if previous is not None else self.state.status
            if study is not self.viewer.study:
                self.state.changed.emit()
                return
            self._compare_result = result
            self.state.changed.emit()
            self.overlays.set_layer(COMPARE_LAYER, result.labels, title=f"compare: {model}", outline=True,
                                    slicer=slicer)
            self.main.show_status(f"Comparison with the {model} model shown as outlines")

        self._segment(study, model, done)

    def cancel(self) -> None:
        """Stop the running segmentation at its next batch."""
        if self.job is not None and not self.job.done:
            self.job.cancel()

    def _progress(self, event: dict[str, Any]) -> None:
        pair = progress_pair(event)
        if pair is not None:
            self.state.set_progress(*pair)

    def _failed(self, exc: BaseException) -> None:
        self.state.fail("cancelled" if is_cancelled(exc) else user_message(exc))

    def go_to_slice(self, index: int) -> None:
        """Show slice ``index`` (a click on the confidence strip)."""
        self.viewer.set_slice("axial", index)

    # --- export --------------------------------------------------------------------------
    def export(self, path: str | Path) -> None:
        """Write the model's mask (NIfTI, PNG or DICOM SEG by suffix) with its provenance."""
        result, study = self.state.result, self._result_study
        if result is None or study is None or study is not self.viewer.study:
            self.main.show_error("Nothing to export", "run the super model on the open study first")
            return
        target = Path(path)
        self.main.set_busy(f"Exporting {target.name} …")

        def job(progress: Callable[[dict[str, Any]], None], cancel: Callable[[], bool]) -> Path:
            return self.api.export_mask(study, result.labels, target, provenance=result.provenance())

        def done(written: Path) -> None:
            self.main.set_busy(None)
            self.main.show_status(f"Exported {written}")

        def failed(exc: BaseException) -> None:
            self.main.set_busy(None)
            self.main.show_error("Export failed", user_message(exc))

        self.tasks.submit(job, on_done=done, on_error=failed)
