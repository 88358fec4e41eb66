"""Confidence strip: per image/slice, the routed model (colour) and the selector's confidence (height)."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QPointF, QRectF, QSize, Qt, Signal
from PySide6.QtGui import QColor, QMouseEvent, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

_SITE_COLOURS = [QColor(31, 119, 180), QColor(255, 127, 14), QColor(44, 160, 44), QColor(214, 39, 40),
                 QColor(148, 103, 189), QColor(140, 86, 75), QColor(227, 119, 194), QColor(188, 189, 34),
                 QColor(23, 190, 207), QColor(255, 187, 120), QColor(152, 223, 138), QColor(255, 152, 150)]
GLOBAL_COLOUR = QColor(150, 150, 150)


def model_colour(name: str, model_names: Sequence[str]) -> QColor:
    """Grey for the global model, one colour per site's personalized model."""
    if name == "global" or name not in model_names:
        return GLOBAL_COLOUR
    index = list(model_names).index(name) - (1 if "global" in model_names else 0)
    return _SITE_COLOURS[index % len(_SITE_COLOURS)]


class ConfidenceStrip(QWidget):
    """One cell per slice along the slice axis: colour = routed model, height = confidence.

    A dashed line marks gamma (below it FedSM routes to the global model); the current slice
    is framed. Clicking a cell emits :attr:`slice_clicked`.
    """

    slice_clicked = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("confidence-strip")
        self.setMinimumHeight(56)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.cells: list[tuple[str, float]] = []
        self.model_names: list[str] = []
        self.current = -1
        self.gamma: float | None = None

    def sizeHint(self) -> QSize:
        return QSize(240, 64)

    def set_data(self, cells: Sequence[tuple[str, float]], model_names: Sequence[str], current: int,
                 gamma: float | None) -> None:
        """Routed model and confidence per slice; ``current`` is framed; ``gamma`` drawn as a line."""
        self.cells = list(cells)
        self.model_names = list(model_names)
        self.current = current
        self.gamma = gamma
        self.update()

    def _plot_rect(self) -> QRectF:
        return QRectF(2, 2, self.width() - 4, self.height() - 16)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(30, 30, 30))
        rect = self._plot_rect()
        painter.setPen(QColor(200, 200, 200))
        if not self.cells:
            painter.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no routing yet: press Run")
            painter.end()
            return
        n = len(self.cells)
        width = rect.width() / n
        for i, (model, conf) in enumerate(self.cells):
            h = max(0.0, min(conf, 1.0)) * rect.height()
            painter.fillRect(QRectF(rect.x() + i * width, rect.bottom() - h, max(width - 1, 1), h),
                             model_colour(model, self.model_names))
        if self.gamma is not None:
            y = rect.bottom() - self.gamma * rect.height()
            painter.setPen(QPen(QColor(255, 255, 255, 180), 1, Qt.PenStyle.DashLine))
            painter.drawLine(QPointF(rect.left(), y), QPointF(rect.right(), y))
        if 0 <= self.current < n:
            painter.setPen(QPen(QColor(255, 230, 0), 2))
            painter.drawRect(QRectF(rect.x() + self.current * width, rect.top(), width, rect.height()))
        painter.setPen(QColor(180, 180, 180))
        text_rect = QRectF(2, rect.bottom() + 1, self.width() - 4, 14)
        if n > 1:
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft, "first slice (inferior)")
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignRight, "last slice (superior)")
        else:
            painter.drawText(text_rect, Qt.AlignmentFlag.AlignLeft, "selector confidence")
        painter.end()

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if not self.cells:
            return
        rect = self._plot_rect()
        index = int((event.position().x() - rect.x()) / max(rect.width(), 1) * len(self.cells))
        if 0 <= index < len(self.cells):
            self.slice_clicked.emit(index)
