"""One 2D slice on screen: image, overlays, crosshair, orientation markers, zoom and pan."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QImage, QKeyEvent, QMouseEvent, QPainter, QPaintEvent, QPen, QWheelEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

#: Mouse-wheel notches per slice step and zoom factor per notch.
_ZOOM_PER_NOTCH = 1.15
_CROSSHAIR = QColor(80, 200, 255, 170)


def to_qimage(array: np.ndarray) -> QImage:
    """Wrap a contiguous ``uint8`` grey, RGB or RGBA array in a ``QImage`` without copying.

    The caller keeps ``array`` alive as long as the image is used.
    """
    h, w = array.shape[:2]
    if array.ndim == 2:
        fmt, bpl = QImage.Format.Format_Grayscale8, w
    elif array.shape[2] == 3:
        fmt, bpl = QImage.Format.Format_RGB888, 3 * w
    elif array.shape[2] == 4:
        fmt, bpl = QImage.Format.Format_RGBA8888, 4 * w
    else:
        raise ValueError(f"cannot show an array of shape {array.shape}")
    if not array.flags.c_contiguous or array.dtype != np.uint8:
        raise ValueError("to_qimage needs a contiguous uint8 array")
    return QImage(array.data, w, h, bpl, fmt)


class SliceCanvas(QWidget):
    """Paints one slice. Emits intents; never changes what it shows by itself.

    Mouse: wheel scrolls slices (volumes) or zooms (photos); Ctrl+wheel zooms; left click/drag
    moves the crosshair (volumes) or pans (photos); middle drag or Shift+left drag pans; right
    drag changes window/level (brightness/contrast on photos); double click fits.
    Keys: Up/Down and PageUp/PageDown scroll (PageUp/PageDown by 5 slices).
    """

    step_requested = Signal(int)
    point_requested = Signal(float, float)
    window_dragged = Signal(float, float)
    zoom_requested = Signal(float)
    pan_requested = Signal(float, float)
    fit_requested = Signal()

    def __init__(self, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.setObjectName(f"canvas-{name}")
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumSize(120, 120)
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self._arrays: list[np.ndarray] = []
        self._image: QImage | None = None
        self._overlays: list[QImage] = []
        self._pixel_mm = (1.0, 1.0)
        self._markers: tuple[str, str, str, str] | None = None
        self._crosshair: tuple[int, int] | None = None
        self._caption = ""
        self._zoom, self._pan = 1.0, QPointF(0, 0)
        self._drag_button: Qt.MouseButton | None = None
        self._drag_mode = ""
        self._last = QPointF()
        self.paints = 0

    # --- content -------------------------------------------------------------------------
    def set_content(self, image: np.ndarray, overlays: list[np.ndarray], pixel_mm: tuple[float, float],
                    markers: tuple[str, str, str, str] | None, crosshair: tuple[int, int] | None,
                    caption: str) -> None:
        """What to paint next (arrays are kept alive while shown)."""
        self._arrays = [image, *overlays]
        self._image = to_qimage(image)
        self._overlays = [to_qimage(o) for o in overlays]
        self._pixel_mm = pixel_mm
        self._markers = markers
        self._crosshair = crosshair
        self._caption = caption
        self.update()

    def clear(self) -> None:
        """Show nothing."""
        self._arrays, self._image, self._overlays = [], None, []
        self.update()

    def set_transform(self, zoom: float, pan_x: float, pan_y: float) -> None:
        """Zoom (1 = fit) and pan in screen pixels."""
        self._zoom, self._pan = float(zoom), QPointF(pan_x, pan_y)
        self.update()

    # --- geometry ------------------------------------------------------------------------
    def image_rect(self) -> QRectF:
        """Where the slice is drawn, in widget coordinates (aspect from the pixel spacing)."""
        if self._image is None:
            return QRectF()
        rows, cols = self._image.height(), self._image.width()
        height_mm, width_mm = rows * self._pixel_mm[0], cols * self._pixel_mm[1]
        fit = min(self.width() / max(width_mm, 1e-9), self.height() / max(height_mm, 1e-9))
        scale = fit * self._zoom
        w, h = width_mm * scale, height_mm * scale
        x = (self.width() - w) / 2 + self._pan.x()
        y = (self.height() - h) / 2 + self._pan.y()
        return QRectF(x, y, w, h)

    def to_pixel(self, pos: QPointF) -> tuple[float, float] | None:
        """Slice ``(row, col)`` under widget position ``pos`` (``None`` outside the slice)."""
        rect = self.image_rect()
        if self._image is None or rect.isEmpty() or not rect.contains(pos):
            return None
        col = (pos.x() - rect.x()) / rect.width() * self._image.width()
        row = (pos.y() - rect.y()) / rect.height() * self._image.height()
        return row, col

    # --- painting ------------------------------------------------------------------------
    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), QColor(0, 0, 0))
        if self._image is not None:
            rect = self.image_rect()
            # bilinear filtering for the image; label overlays stay crisp (nearest neighbour)
            painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, True)
            painter.drawImage(rect, self._image)
            painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform, False)
            for overlay in self._overlays:
                painter.drawImage(rect, overlay)
            if self._crosshair is not None:
                row, col = self._crosshair
                x = rect.x() + (col + 0.5) / self._image.width() * rect.width()
                y = rect.y() + (row + 0.5) / self._image.height() * rect.height()
                painter.setPen(QPen(_CROSSHAIR, 1, Qt.PenStyle.DashLine))
                painter.drawLine(QPointF(rect.left(), y), QPointF(rect.right(), y))
                painter.drawLine(QPointF(x, rect.top()), QPointF(x, rect.bottom()))
        self._paint_text(painter)
        painter.end()
        self.paints += 1

    def _paint_text(self, painter: QPainter) -> None:
        font = QFont(self.font())
        font.setBold(True)
        painter.setFont(font)
        painter.setPen(QColor(255, 210, 80))
        r = self.rect().adjusted(6, 4, -6, -4)
        if self._markers is not None:
            top, bottom, left, right = self._markers
            painter.drawText(r, Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop, top)
            painter.drawText(r, Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignBottom, bottom)
            painter.drawText(r, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, left)
            painter.drawText(r, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, right)
        if self._caption:
            painter.setPen(QColor(230, 230, 230))
            painter.drawText(r, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop, self._caption)

    # --- input ---------------------------------------------------------------------------
    def wheelEvent(self, event: QWheelEvent) -> None:
        notches = event.angleDelta().y() / 120.0
        if not notches:
            return
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier or self._markers is None:
            self.zoom_requested.emit(_ZOOM_PER_NOTCH ** notches)
        else:
            self.step_requested.emit(1 if notches > 0 else -1)
        event.accept()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        steps = {Qt.Key.Key_Up: 1, Qt.Key.Key_Down: -1, Qt.Key.Key_Right: 1, Qt.Key.Key_Left: -1,
                 Qt.Key.Key_PageUp: 5, Qt.Key.Key_PageDown: -5}
        key = Qt.Key(event.key())
        if key in steps and self._markers is not None:
            self.step_requested.emit(steps[key])
            event.accept()
            return
        super().keyPressEvent(event)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        self.setFocus()
        self._last = event.position()
        button = event.button()
        shift = bool(event.modifiers() & Qt.KeyboardModifier.ShiftModifier)
        if button == Qt.MouseButton.RightButton:
            self._drag_mode = "window"
        elif button == Qt.MouseButton.MiddleButton or (button == Qt.MouseButton.LeftButton
                                                       and (shift or self._markers is None)):
            self._drag_mode = "pan"
        elif button == Qt.MouseButton.LeftButton:
            self._drag_mode = "point"
            self._emit_point(event.position())
        self._drag_button = button

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        pos = event.position()
        delta = pos - self._last
        self._last = pos
        if self._drag_mode == "window":
            self.window_dragged.emit(delta.x(), delta.y())
        elif self._drag_mode == "pan":
            self.pan_requested.emit(delta.x(), delta.y())
        elif self._drag_mode == "point":
            self._emit_point(pos)

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        self._drag_mode, self._drag_button = "", None

    def mouseDoubleClickEvent(self, event: QMouseEvent) -> None:
        self.fit_requested.emit()

    def _emit_point(self, pos: QPointF) -> None:
        pixel = self.to_pixel(pos)
        if pixel is not None:
            self.point_requested.emit(*pixel)
