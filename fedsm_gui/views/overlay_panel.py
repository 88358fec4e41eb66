"""Overlay controls: opacity, show/hide, fill/outline per layer, legend with per-label visibility."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QCheckBox,
    QColorDialog,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QVBoxLayout,
    QWidget,
)


class OverlayPanel(QGroupBox):
    """Concrete :class:`~fedsm_gui.views.bases.OverlayView`."""

    opacity_changed = Signal(float)
    outline_toggled = Signal(str, bool)
    layer_visibility_toggled = Signal(str, bool)
    label_visibility_toggled = Signal(str, int, bool)
    label_colour_requested = Signal(str, int)
    visibility_toggled = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Overlays", parent)
        self.show_box = QCheckBox("Show overlays (H)")
        self.show_box.setObjectName("overlay-visible")
        self.show_box.toggled.connect(self.visibility_toggled)
        self.opacity = QSlider(Qt.Orientation.Horizontal)
        self.opacity.setObjectName("overlay-opacity")
        self.opacity.setRange(0, 100)
        self.opacity.valueChanged.connect(lambda v: self.opacity_changed.emit(v / 100.0))
        row = QHBoxLayout()
        row.addWidget(self.show_box)
        row.addWidget(QLabel("Opacity"))
        row.addWidget(self.opacity, 1)
        self.legend = QVBoxLayout()
        self.empty = QLabel("No mask yet: run the super model or open a mask (File ▸ Open mask).")
        self.empty.setWordWrap(True)
        self.empty.setStyleSheet("color: #888;")
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.empty)
        layout.addLayout(self.legend)
        self.label_boxes: dict[tuple[str, int], QCheckBox] = {}
        self.outline_boxes: dict[str, QCheckBox] = {}

    def set_controls(self, opacity: float, visible: bool) -> None:
        for widget, setter in ((self.opacity, lambda: self.opacity.setValue(round(opacity * 100))),
                               (self.show_box, lambda: self.show_box.setChecked(visible))):
            widget.blockSignals(True)
            setter()
            widget.blockSignals(False)

    def set_legend(self, layers: Sequence[dict[str, Any]]) -> None:
        while self.legend.count():
            item = self.legend.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        self.label_boxes.clear()
        self.outline_boxes.clear()
        self.empty.setVisible(not layers)
        for layer in layers:
            key = layer["key"]
            box = QWidget()
            col = QVBoxLayout(box)
            col.setContentsMargins(0, 4, 0, 0)
            head = QHBoxLayout()
            shown = QCheckBox(layer["title"])
            shown.setChecked(layer["visible"])
            shown.setStyleSheet("font-weight: bold;")
            shown.toggled.connect(lambda on, k=key: self.layer_visibility_toggled.emit(k, on))
            outline = QCheckBox("outline")
            outline.setObjectName(f"outline-{key}")
            outline.setChecked(layer["outline"])
            outline.toggled.connect(lambda on, k=key: self.outline_toggled.emit(k, on))
            self.outline_boxes[key] = outline
            head.addWidget(shown)
            head.addStretch(1)
            head.addWidget(outline)
            col.addLayout(head)
            for label in layer["labels"]:
                line = QHBoxLayout()
                swatch = QPushButton()
                swatch.setFixedSize(18, 18)
                r, g, b = label["colour"]
                swatch.setStyleSheet(f"background: rgb({r},{g},{b}); border: 1px solid #444;")
                swatch.setToolTip("Change colour")
                swatch.clicked.connect(lambda _=False, k=key, v=label["value"]: self.label_colour_requested.emit(k, v))
                check = QCheckBox(f"{label['value']}: {label['name']}")
                check.setChecked(label["visible"])
                check.toggled.connect(lambda on, k=key, v=label["value"]: self.label_visibility_toggled.emit(k, v, on))
                self.label_boxes[(key, int(label["value"]))] = check
                line.addSpacing(16)
                line.addWidget(swatch)
                line.addWidget(check, 1)
                col.addLayout(line)
            self.legend.addWidget(box)

    def choose_colour(self, current: tuple[int, int, int]) -> tuple[int, int, int] | None:
        colour = QColorDialog.getColor(QColor(*current), self, "Label colour")
        if not colour.isValid():
            return None
        return colour.red(), colour.green(), colour.blue()
