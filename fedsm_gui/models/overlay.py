"""Overlays on the study: the model's mask and a loaded mask to compare with, each with a legend."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.io.study import LabelMap
from fedsm_gui.models.display import Slicer, default_colour, overlay_lut
from fedsm_gui.models.signal import Signal

MODEL_LAYER = "model"
REFERENCE_LAYER = "reference"
#: Reference masks take colours further down the palette so both layers stay distinguishable.
_REFERENCE_COLOUR_OFFSET = 3


@dataclass
class LabelStyle:
    """How one label value is drawn and named in the legend."""

    name: str
    colour: tuple[int, int, int]
    visible: bool = True


@dataclass
class OverlayLayer:
    """One label map on screen."""

    title: str
    labels: LabelMap
    slicer: Slicer
    styles: dict[int, LabelStyle] = field(default_factory=dict)
    outline: bool = False
    visible: bool = True


class OverlayState:
    """Qt-free overlay state: layers, opacity, fill/outline, per-label colour and visibility.

    Signals
    -------
    changed()
        Anything about the overlays changed (views redraw, the legend is rebuilt).
    """

    def __init__(self) -> None:
        self.layers: dict[str, OverlayLayer] = {}
        self.opacity = 0.5
        self.visible = True
        self.changed = Signal()
        self._luts: dict[str, np.ndarray] = {}

    def set_layer(self, key: str, labels: LabelMap, title: str | None = None, outline: bool | None = None,
                  slicer: Slicer | None = None) -> None:
        """Show ``labels`` as layer ``key`` (``"model"`` or ``"reference"``), keeping known styles.

        ``slicer`` serves the label slices (built here when not given).
        """
        old = self.layers.get(key)
        offset = _REFERENCE_COLOUR_OFFSET if key == REFERENCE_LAYER else 0
        slicer = slicer or Slicer(labels.array, labels.array.ndim == 3)
        values = sorted(set(labels.names) | {v for v in slicer.label_values() if v > 0})
        styles = {}
        for value in values:
            name = labels.names.get(value, f"label {value}")
            if old is not None and value in old.styles:
                prev = old.styles[value]
                styles[value] = LabelStyle(name, prev.colour, prev.visible)
            else:
                styles[value] = LabelStyle(name, default_colour(value + offset))
        if outline is None:
            outline = old.outline if old is not None else key == REFERENCE_LAYER
        self.layers[key] = OverlayLayer(title or (old.title if old else key), labels, slicer, styles, outline,
                                        old.visible if old else True)
        self._share_names()
        self._changed()

    def _share_names(self) -> None:
        """Give a label a layer knows only by number (``label 2``) the name another layer uses for it.

        A mask file without names (a NIfTI label map) shown beside the model's mask then reads
        ``prostate`` or ``cup`` like the model's own legend, since both follow the task's convention.
        """
        known: dict[int, str] = {}
        for layer in self.layers.values():
            for value, style in layer.styles.items():
                if style.name != f"label {value}":
                    known.setdefault(value, style.name)
        for layer in self.layers.values():
            for value, style in layer.styles.items():
                if style.name == f"label {value}" and value in known:
                    style.name = known[value]

    def remove_layer(self, key: str) -> None:
        """Stop showing layer ``key`` (no-op when absent)."""
        if self.layers.pop(key, None) is not None:
            self._changed()

    def clear(self) -> None:
        """Remove every layer (a new study was opened)."""
        if self.layers:
            self.layers.clear()
            self._changed()

    def set_opacity(self, opacity: float) -> None:
        """Opacity of every fill, 0..1."""
        self.opacity = min(max(float(opacity), 0.0), 1.0)
        self._changed()

    def set_visible(self, visible: bool) -> None:
        """Show or hide all overlays (the hide/show hotkey)."""
        self.visible = bool(visible)
        self._changed()

    def toggle_visible(self) -> None:
        """Flip :attr:`visible`."""
        self.set_visible(not self.visible)

    def set_layer_visible(self, key: str, visible: bool) -> None:
        """Show or hide one layer."""
        self.layers[key].visible = bool(visible)
        self._changed()

    def set_outline(self, key: str, outline: bool) -> None:
        """Draw layer ``key`` filled (False) or as outlines (True)."""
        self.layers[key].outline = bool(outline)
        self._changed()

    def set_label_visible(self, key: str, value: int, visible: bool) -> None:
        """Show or hide one label of one layer."""
        self.layers[key].styles[int(value)].visible = bool(visible)
        self._changed()

    def set_label_colour(self, key: str, value: int, colour: tuple[int, int, int]) -> None:
        """Colour of one label of one layer."""
        self.layers[key].styles[int(value)].colour = tuple(int(c) for c in colour)  # type: ignore[assignment]
        self._changed()

    def shown_layers(self) -> list[tuple[str, OverlayLayer]]:
        """Layers to draw, bottom first (nothing when overlays are hidden)."""
        if not self.visible:
            return []
        order = [k for k in (REFERENCE_LAYER, MODEL_LAYER) if k in self.layers]
        order += [k for k in self.layers if k not in order]
        return [(k, self.layers[k]) for k in order if self.layers[k].visible]

    def lut(self, key: str) -> np.ndarray:
        """RGBA lookup table of layer ``key`` at the current opacity (cached until the next change)."""
        if key not in self._luts:
            layer = self.layers[key]
            self._luts[key] = overlay_lut({v: (s.colour, s.visible) for v, s in layer.styles.items()}, self.opacity)
        return self._luts[key]

    def _changed(self) -> None:
        self._luts.clear()
        self.changed.emit()
