"""Connects the viewer state and overlays to the slice views: rendering and interaction."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsm_gui.models.display import (
    MARKERS,
    PHOTO_VIEW,
    adjust_photo,
    apply_window,
    display_to_voxel,
    overlay_rgba,
    pixel_size_mm,
    voxel_to_display,
)
from fedsm_gui.models.overlay import OverlayState
from fedsm_gui.models.viewer import ViewerState
from fedsm_gui.views.bases import ViewerView

#: Screen pixels of right-drag that change the window width (or level) by one window width.
DRAG_PIXELS_PER_WIDTH = 250.0
#: Message shown by the viewer when no study is open.
EMPTY_MESSAGE = ("No study open.\nOpen a fundus photo, a NIfTI/MHA/NRRD volume or a DICOM folder "
                 "(File ▸ Open, or drop it here), or start with  fedsm-gui --demo.")


class ViewerController:
    """Renders the current study into every view and turns view intents into state changes.

    Rendering is numpy only (window/level, orientation, overlay colouring); a view just wraps
    the arrays it gets. Rendered slices are cached per view, so moving the crosshair through
    one view does not recompute the others' unchanged images.
    """

    def __init__(self, state: ViewerState, overlays: OverlayState, view: ViewerView) -> None:
        self.state = state
        self.overlays = overlays
        self.view = view
        self._generation = 0
        self._cache: dict[str, tuple[Any, np.ndarray, list[np.ndarray]]] = {}
        state.study_changed.connect(self._on_study)
        state.slices_changed.connect(self.render)
        state.display_changed.connect(self._on_display)
        state.transform_changed.connect(self._on_transform)
        overlays.changed.connect(self._invalidate_and_render)
        view.slice_step_requested.connect(self.step_slice)
        view.slice_requested.connect(self.set_slice)
        view.cursor_requested.connect(self.click)
        view.window_drag_requested.connect(self.drag_window)
        view.preset_requested.connect(self.apply_preset)
        view.zoom_requested.connect(self.zoom)
        view.pan_requested.connect(self.pan)
        view.fit_requested.connect(self.fit)
        view.photo_adjust_requested.connect(self.adjust_photo)
        view.green_toggled.connect(self.toggle_green)
        view.hover_requested.connect(self.hover)
        self._on_study()

    # --- state -> view -------------------------------------------------------------------
    def _on_study(self) -> None:
        self._invalidate()
        study = self.state.study
        self.view.set_views(self.state.views, "" if study is not None else EMPTY_MESSAGE)
        if study is None:
            return
        if study.kind == "volume":
            self.view.set_window(*self.state.window, list(self.state.presets))
        else:
            self.view.set_photo_controls(self.state.brightness, self.state.contrast, self.state.green_only)
        for name in self.state.views:
            self._on_transform(name)
        self.render()

    def _on_display(self) -> None:
        self._invalidate()
        if self.state.study is not None and self.state.study.kind == "volume":
            self.view.set_window(*self.state.window, list(self.state.presets))
        else:
            self.view.set_photo_controls(self.state.brightness, self.state.contrast, self.state.green_only)
        self.render()

    def _on_transform(self, view: str) -> None:
        t = self.state.transform(view)
        self.view.set_transform(view, t.zoom, t.pan_x, t.pan_y)

    def _invalidate(self) -> None:
        self._generation += 1
        self._cache.clear()

    def _invalidate_and_render(self) -> None:
        self._invalidate()
        self.render()

    def render_view(self, view: str) -> None:
        """Push ``view``'s current slice, overlays, markers and crosshair to the view."""
        study = self.state.study
        if study is None:
            return
        index = self.state.slice_index(view)
        key = (self._generation, index)
        cached = self._cache.get(view)
        if cached is not None and cached[0] == key:
            image, overlays = cached[1], cached[2]
        else:
            image, overlays = self._render_slice(view, index)
            self._cache[view] = (key, image, overlays)
        if view == PHOTO_VIEW:
            markers, crosshair = None, None
        else:
            markers = MARKERS[view]
            crosshair = voxel_to_display(view, tuple(self.state.cursor), study.shape)  # type: ignore[arg-type]
        self.view.set_slice(view, image, overlays, pixel_size_mm(study.spacing, view), markers, crosshair,
                            index, self.state.num_slices(view))

    def render(self) -> None:
        """Redraw every view of the current study."""
        for view in self.state.views:
            self.render_view(view)

    def _render_slice(self, view: str, index: int) -> tuple[np.ndarray, list[np.ndarray]]:
        study, slicer = self.state.study, self.state.slicer
        assert study is not None and slicer is not None
        raw = slicer.slice(view, index)
        if study.kind == "photo":
            image = adjust_photo(raw, self.state.brightness, self.state.contrast, self.state.green_only)
        else:
            image = apply_window(raw, *self.state.window)
        overlays = []
        for key, layer in self.overlays.shown_layers():
            if layer.labels.array.shape[:len(study.shape)] != study.shape:
                continue
            labels = layer.slicer.slice(view, index)
            overlays.append(overlay_rgba(labels, self.overlays.lut(key), layer.outline))
        return image, overlays

    # --- view intents -> state -----------------------------------------------------------
    def step_slice(self, view: str, step: int) -> None:
        """Scroll ``view`` by ``step`` slices (wheel, arrows, PageUp/PageDown)."""
        self.state.set_slice(view, self.state.slice_index(view) + int(step))

    def set_slice(self, view: str, index: int) -> None:
        """Go to slice ``index`` of ``view`` (slider)."""
        self.state.set_slice(view, index)

    def click(self, view: str, row: float, col: float) -> None:
        """Put the crosshair where the user clicked in ``view`` (volumes)."""
        study = self.state.study
        if study is None or study.kind != "volume" or view == PHOTO_VIEW:
            return
        voxel = display_to_voxel(view, self.state.slice_index(view), math.floor(row), math.floor(col),
                                 study.shape)
        self.state.set_cursor(voxel)

    def drag_window(self, dx: float, dy: float) -> None:
        """Right-drag: horizontal changes width (contrast), vertical changes level (brightness).

        On photos the same drag changes contrast and brightness.
        """
        study = self.state.study
        if study is None:
            return
        if study.kind == "photo":
            self.state.set_photo_adjustment(brightness=self.state.brightness - dy / (4 * DRAG_PIXELS_PER_WIDTH),
                                            contrast=self.state.contrast * math.exp(dx / DRAG_PIXELS_PER_WIDTH))
            return
        center, width = self.state.window
        self.state.set_window(center + dy * width / DRAG_PIXELS_PER_WIDTH,
                              width * math.exp(dx / DRAG_PIXELS_PER_WIDTH))

    def apply_preset(self, name: str) -> None:
        """Switch to a named window preset."""
        if name in self.state.presets:
            self.state.set_window(*self.state.presets[name])

    def zoom(self, view: str, factor: float) -> None:
        """Zoom ``view`` by ``factor``."""
        self.state.zoom(view, factor)

    def pan(self, view: str, dx: float, dy: float) -> None:
        """Pan ``view``."""
        self.state.pan(view, dx, dy)

    def fit(self) -> None:
        """Fit every view."""
        self.state.fit()

    def adjust_photo(self, brightness: float, contrast: float) -> None:
        """Photo brightness and contrast (sliders)."""
        self.state.set_photo_adjustment(brightness=brightness, contrast=contrast)

    def hover(self, view: str, row: float, col: float) -> None:
        """Show what lies under the pointer: voxel, world position (RAS mm), value and labels."""
        self.view.set_readout(self.readout(view, row, col))

    def readout(self, view: str, row: float, col: float) -> str:
        """The readout text for slice position ``(row, col)`` of ``view`` (``""`` off the slice)."""
        study = self.state.study
        if study is None or row < 0 or col < 0:
            return ""
        r, c = math.floor(row), math.floor(col)
        if view == PHOTO_VIEW:
            if not (0 <= r < study.shape[0] and 0 <= c < study.shape[1]):
                return ""
            index: tuple[int, ...] = (r, c)
            rgb = ", ".join(str(int(v)) for v in np.atleast_1d(study.array[r, c]))
            text = f"x {c}  y {r}   RGB ({rgb})"
        else:
            index = display_to_voxel(view, self.state.slice_index(view), r, c, study.shape)
            if not all(0 <= i < n for i, n in zip(index, study.shape, strict=True)):
                return ""
            world = np.asarray(study.affine, dtype=float) @ np.array([*index, 1.0])
            value = float(study.array[index])
            text = (f"voxel ({', '.join(map(str, index))})   R {world[0]:.1f}  A {world[1]:.1f}  S {world[2]:.1f} mm"
                    f"   value {value:.6g}")
        for key, layer in self.overlays.layers.items():
            label = int(layer.labels.array[index])
            if label:
                style = layer.styles.get(label)
                text += f"   {key}: {style.name if style else label}"
        return text

    def toggle_green(self, on: bool) -> None:
        """Show the green channel only (fundus red-free view)."""
        self.state.set_photo_adjustment(green_only=on)
