"""A small line plot drawn with QPainter: one line per series over rounds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

_COLOURS = [QColor(31, 119, 180), QColor(255, 127, 14), QColor(44, 160, 44), QColor(214, 39, 40),
            QColor(148, 103, 189), QColor(140, 86, 75)]


class RoundPlot(QWidget):
    """Values per round, one coloured line per series, with axes and a legend."""

    def __init__(self, title: str, y_range: tuple[float, float] | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = title
        self.y_range = y_range
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.setMinimumSize(220, 150)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def sizeHint(self) -> QSize:
        return QSize(320, 200)

    def set_series(self, series: Mapping[str, Sequence[tuple[int, float]]]) -> None:
        """Replace the plotted data: name -> ``[(round, value), ...]``."""
        self.series = {k: sorted(v) for k, v in series.items() if v}
        self.update()

    def _ranges(self) -> tuple[float, float, float, float]:
        points = [p for values in self.series.values() for p in values]
        x_lo, x_hi = 1.0, float(max([p[0] for p in points], default=1))
        if self.y_range is not None:
            y_lo, y_hi = self.y_range
        else:
            ys = [p[1] for p in points] or [0.0, 1.0]
            y_lo, y_hi = min(0.0, min(ys)), max(ys)
            y_hi = y_hi if y_hi > y_lo else y_lo + 1.0
        return x_lo, max(x_hi, x_lo + 1), y_lo, y_hi

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), QColor(255, 255, 255))
        plot = QRectF(42, 22, self.width() - 52, self.height() - 48)
        painter.setPen(QColor(40, 40, 40))
        painter.drawText(QRectF(0, 2, self.width(), 18), Qt.AlignmentFlag.AlignHCenter, self.title)
        painter.setPen(QColor(120, 120, 120))
        painter.drawRect(plot)
        x_lo, x_hi, y_lo, y_hi = self._ranges()

        def to_screen(x: float, y: float) -> QPointF:
            return QPointF(plot.left() + (x - x_lo) / (x_hi - x_lo) * plot.width(),
                           plot.bottom() - (y - y_lo) / (y_hi - y_lo) * plot.height())

        for frac in (0.0, 0.5, 1.0):
            value = y_lo + frac * (y_hi - y_lo)
            y = plot.bottom() - frac * plot.height()
            painter.drawText(QRectF(0, y - 8, 38, 16), Qt.AlignmentFlag.AlignRight, f"{value:.2f}")
        for r in range(int(x_lo), int(x_hi) + 1):
            x = to_screen(r, y_lo).x()
            painter.drawText(QRectF(x - 15, plot.bottom() + 2, 30, 14), Qt.AlignmentFlag.AlignHCenter, str(r))
        painter.drawText(QRectF(plot.left(), plot.bottom() + 12, plot.width(), 14),
                         Qt.AlignmentFlag.AlignHCenter, "round")
        if not self.series:
            painter.drawText(plot, Qt.AlignmentFlag.AlignCenter, "no rounds yet")
        legend_x = plot.left() + 6
        for i, (name, values) in enumerate(self.series.items()):
            colour = _COLOURS[i % len(_COLOURS)]
            painter.setPen(QPen(colour, 2))
            path = QPainterPath()
            for j, (x, y) in enumerate(values):
                point = to_screen(x, y)
                path.moveTo(point) if j == 0 else path.lineTo(point)
            painter.drawPath(path)
            painter.setBrush(colour)
            for x, y in values:
                painter.drawEllipse(to_screen(x, y), 3, 3)
            painter.setBrush(Qt.BrushStyle.NoBrush)
            painter.drawText(QPointF(legend_x, plot.top() + 14 + 14 * i), name)
        painter.end()
