"""What the study viewer shows: the study, slice per axis, window/level, zoom/pan, photo settings."""

from __future__ import annotations

from dataclasses import dataclass

from engine.io.study import Study
from fedsm_gui.models.display import (
    PHOTO_VIEW,
    SLICE_AXIS,
    VOLUME_VIEWS,
    Slicer,
    window_presets,
)
from fedsm_gui.models.signal import Signal

#: Zoom limits relative to "fit the view".
MIN_ZOOM, MAX_ZOOM = 0.25, 32.0


@dataclass
class ViewTransform:
    """Zoom (1 = whole slice fits the view) and pan (screen pixels) of one view."""

    zoom: float = 1.0
    pan_x: float = 0.0
    pan_y: float = 0.0


WindowDefaults = tuple[dict[str, tuple[float, float]], tuple[float, float]]


def window_defaults(study: Study) -> WindowDefaults:
    """A volume's window presets and its initial window (the file's default, else auto 1–99 %).

    Percentiles over a 512 × 512 × 300 volume take ~0.1 s, so the study controller computes
    this in the worker that opened the study, not on the GUI thread.
    """
    presets = window_presets(study.modality, study.array, study.window)
    center, width = study.window if study.window is not None else presets["Auto (1–99 %)"]
    return presets, (float(center), max(float(width), 1e-6))


class ViewerState:
    """Qt-free state of the viewer.

    Signals
    -------
    study_changed()
        A new study (or none) is shown.
    slices_changed()
        The cursor (slice index per axis) moved.
    display_changed()
        Window/level or photo settings changed (every view must be redrawn).
    transform_changed(view)
        Zoom or pan of ``view`` changed.
    """

    def __init__(self) -> None:
        self.study: Study | None = None
        self.slicer: Slicer | None = None
        self.cursor: list[int] = [0, 0, 0]
        self.window: tuple[float, float] = (0.5, 1.0)
        self.presets: dict[str, tuple[float, float]] = {}
        self.brightness = 0.0
        self.contrast = 1.0
        self.green_only = False
        self.transforms: dict[str, ViewTransform] = {}
        self.study_changed = Signal()
        self.slices_changed = Signal()
        self.display_changed = Signal()
        self.transform_changed = Signal()

    # --- study ---------------------------------------------------------------------------
    @property
    def views(self) -> tuple[str, ...]:
        """The views the current study is shown in (none without a study)."""
        if self.study is None:
            return ()
        return (PHOTO_VIEW,) if self.study.kind == "photo" else VOLUME_VIEWS

    def set_study(self, study: Study | None, slicer: Slicer | None = None,
                  defaults: WindowDefaults | None = None) -> None:
        """Show ``study``: cursor at the centre, its default window, every view fitted.

        ``slicer`` serves its slices and ``defaults`` (:func:`window_defaults`) are its window
        presets; both are computed here when not given (compute them in a worker for big volumes).
        """
        self.study = study
        self.slicer = None if study is None else (slicer or Slicer(study.array, study.kind == "volume"))
        self.transforms = {view: ViewTransform() for view in self.views}
        self.brightness, self.contrast, self.green_only = 0.0, 1.0, False
        if study is not None and study.kind == "volume":
            self.cursor = [s // 2 for s in study.shape]
            self.presets, self.window = defaults if defaults is not None else window_defaults(study)
        else:
            self.cursor = [0, 0, 0]
            self.presets = {}
        self.study_changed.emit()

    # --- slices --------------------------------------------------------------------------
    def num_slices(self, view: str) -> int:
        """Slices ``view`` can scroll through (1 for photos, 0 without a study)."""
        if self.study is None:
            return 0
        if view == PHOTO_VIEW:
            return 1
        return int(self.study.shape[SLICE_AXIS[view]])

    def slice_index(self, view: str) -> int:
        """Current slice of ``view``."""
        return 0 if view == PHOTO_VIEW else self.cursor[SLICE_AXIS[view]]

    def set_slice(self, view: str, index: int) -> bool:
        """Move ``view`` to slice ``index`` (clamped); return whether anything changed."""
        if self.study is None or view == PHOTO_VIEW:
            return False
        axis = SLICE_AXIS[view]
        index = min(max(int(index), 0), self.num_slices(view) - 1)
        if self.cursor[axis] == index:
            return False
        self.cursor[axis] = index
        self.slices_changed.emit()
        return True

    def set_cursor(self, voxel: tuple[int, int, int]) -> None:
        """Put the crosshair on ``voxel``: every view shows the slices through it."""
        if self.study is None or self.study.kind != "volume":
            return
        clamped = [min(max(int(v), 0), s - 1) for v, s in zip(voxel, self.study.shape, strict=True)]
        if clamped != self.cursor:
            self.cursor = clamped
            self.slices_changed.emit()

    # --- display -------------------------------------------------------------------------
    def set_window(self, center: float, width: float) -> None:
        """Window/level of volumes (``width`` is kept positive)."""
        self.window = (float(center), max(float(width), 1e-6))
        self.display_changed.emit()

    def set_photo_adjustment(self, brightness: float | None = None, contrast: float | None = None,
                             green_only: bool | None = None) -> None:
        """Photo brightness (-1..1), contrast (0.1..10) and the green-channel toggle."""
        if brightness is not None:
            self.brightness = min(max(float(brightness), -1.0), 1.0)
        if contrast is not None:
            self.contrast = min(max(float(contrast), 0.1), 10.0)
        if green_only is not None:
            self.green_only = bool(green_only)
        self.display_changed.emit()

    def transform(self, view: str) -> ViewTransform:
        """Zoom and pan of ``view``."""
        return self.transforms.setdefault(view, ViewTransform())

    def zoom(self, view: str, factor: float) -> None:
        """Multiply ``view``'s zoom by ``factor`` (kept within 0.25x..32x of fit)."""
        t = self.transform(view)
        t.zoom = min(max(t.zoom * float(factor), MIN_ZOOM), MAX_ZOOM)
        self.transform_changed.emit(view)

    def pan(self, view: str, dx: float, dy: float) -> None:
        """Shift ``view`` by ``(dx, dy)`` screen pixels."""
        t = self.transform(view)
        t.pan_x += float(dx)
        t.pan_y += float(dy)
        self.transform_changed.emit(view)

    def fit(self, view: str | None = None) -> None:
        """Reset zoom and pan of ``view`` (every view when ``None``)."""
        for name in (view,) if view else self.views:
            self.transforms[name] = ViewTransform()
            self.transform_changed.emit(name)
