"""Connects the overlay state to the overlay panel (legend, opacity, fill/outline, visibility)."""

from __future__ import annotations

from typing import Any

from fedsm_gui.models.overlay import OverlayState
from fedsm_gui.views.bases import OverlayView


class OverlayController:
    """Keeps the legend in step with the overlay layers and applies the panel's intents."""

    def __init__(self, overlays: OverlayState, view: OverlayView) -> None:
        self.overlays = overlays
        self.view = view
        overlays.changed.connect(self.refresh)
        view.opacity_changed.connect(overlays.set_opacity)
        view.outline_toggled.connect(self.set_outline)
        view.layer_visibility_toggled.connect(self.set_layer_visible)
        view.label_visibility_toggled.connect(self.set_label_visible)
        view.label_colour_requested.connect(self.choose_colour)
        view.visibility_toggled.connect(overlays.set_visible)
        self.refresh()

    def legend(self) -> list[dict[str, Any]]:
        """The legend rows: one entry per layer with its labels."""
        rows = []
        for key, layer in self.overlays.layers.items():
            rows.append({
                "key": key, "title": layer.title, "outline": layer.outline, "visible": layer.visible,
                "labels": [{"value": v, "name": s.name, "colour": s.colour, "visible": s.visible}
                           for v, s in sorted(layer.styles.items())],
            })
        return rows

    def refresh(self) -> None:
        """Redraw the legend and controls from the state."""
        self.view.set_legend(self.legend())
        self.view.set_controls(self.overlays.opacity, self.overlays.visible)

    def set_outline(self, layer: str, outline: bool) -> None:
        if layer in self.overlays.layers:
            self.overlays.set_outline(layer, outline)

    def set_layer_visible(self, layer: str, visible: bool) -> None:
        if layer in self.overlays.layers:
            self.overlays.set_layer_visible(layer, visible)

    def set_label_visible(self, layer: str, value: int, visible: bool) -> None:
        if layer in self.overlays.layers and value in self.overlays.layers[layer].styles:
            self.overlays.set_label_visible(layer, value, visible)

    def choose_colour(self, layer: str, value: int) -> None:
        """Ask the view for a new colour of one label."""
        if layer not in self.overlays.layers or value not in self.overlays.layers[layer].styles:
            return
        colour = self.view.choose_colour(self.overlays.layers[layer].styles[value].colour)
        if colour is not None:
            self.overlays.set_label_colour(layer, value, colour)
