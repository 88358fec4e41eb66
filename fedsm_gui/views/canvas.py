"""One 2D slice on screen: image, overlays, crosshair, orientation markers, zoom and pan."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QEvent, QPointF, QRect, QRectF, Qt, Signal
from PySide6.QtGui import (
    QColor,
    QEnterEvent,
    QFont,
    QImage,
    QKeyEvent,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QPen,
    QWheelEvent,
)
from PySide6.QtWidgets import QSizePolicy, QWidget

#: Mouse-wheel notches per slice step and zoom factor per notch.
_ZOOM_PER_NOTCH = 1.15
_CROSSHAIR = QColor(80, 200, 255, 170)
_MARKER = QColor(255, 210, 80)
_HALO = QColor(0, 0, 0, 230)
_RULER = QColor(120, 255, 120)


def distance_text(start: tuple[float, float], end: tuple[float, float], pixel_mm: tuple[float, float],
                  physical: bool) -> str:
    """Length of the line ``start``-``end`` (slice ``(row, col)``): mm with the pixel spacing, else pixels."""
    rows, cols = end[0] - start[0], end[1] - start[1]
    if physical:
        return f"{float(np.hypot(rows * pixel_mm[0], cols * pixel_mm[1])):.1f} mm"
    return f"{float(np.hypot(rows, cols)):.1f} px"


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
    Keys: Up/Down and PageUp/PageDown scroll (PageUp/PageDown by 5 slices); the main window
    routes the same keys here from wherever the focus is. With :attr:`measuring` on, left drag
    draws a ruler labelled with its length. Pointer moves report the slice position under it
    (:attr:`hovered`) for the value readout.
    """

    step_requested = Signal(int)
    point_requested = Signal(float, float)
    hovered = Signal(float, float)  # slice (row, col) under the pointer; (-1, -1) when it left the slice
    activated = Signal()  # clicked or entered: the view arrow keys scroll
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
        self.setMouseTracking(True)
        self.measuring = False  # left drag draws a ruler instead of moving the crosshair / panning
        self.ruler: tuple[tuple[float, float], tuple[float, float]] | None = None
        self.physical_units = True  # millimetres (volumes) or pixels (photos)

    # --- content -------------------------------------------------------------------------
    def set_content(self, image: np.ndarray, overlays: list[np.ndarray], pixel_mm: tuple[float, float],
                    markers: tuple[str, str, str, str] | None, crosshair: tuple[int, int] | None,
                    caption: str) -> None:
        """What to paint next (arrays are kept alive while shown)."""
        if self._image is not None and (self._image.height(), self._image.width()) != image.shape[:2]:
            self.ruler = None  # another study or view shape: the ruler would point nowhere
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
        self.ruler = None
        self.update()

    def set_measuring(self, on: bool) -> None:
        """Distance tool on (left drag measures) or off (the ruler is removed)."""
        self.measuring = bool(on)
        if not on:
            self.ruler = None
        self.setCursor(Qt.CursorShape.CrossCursor if on else Qt.CursorShape.ArrowCursor)
        self.update()

    def ruler_text(self) -> str:
        """The current measurement (``""`` when none)."""
        if self.ruler is None:
            return ""
        return distance_text(self.ruler[0], self.ruler[1], self._pixel_mm, self.physical_units)

    def to_widget(self, row: float, col: float) -> QPointF:
        """Widget position of slice position ``(row, col)``."""
        rect = self.image_rect()
        assert self._image is not None
        return QPointF(rect.x() + col / self._image.width() * rect.width(),
                       rect.y() + row / self._image.height() * rect.height())

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
            if self.ruler is not None:
                self._paint_ruler(painter)
        self._paint_text(painter)
        painter.end()
        self.paints += 1

    @staticmethod
    def _halo_text(painter: QPainter, rect: QRectF | QRect, flags: Qt.AlignmentFlag, text: str, colour: QColor) -> None:
        """Text with a dark outline, legible on bright tissue and on black (as ITK-SNAP and OHIF draw it)."""
        painter.setPen(_HALO)
        for dx, dy in ((-1, -1), (0, -1), (1, -1), (-1, 0), (1, 0), (-1, 1), (0, 1), (1, 1)):
            painter.drawText(rect.translated(dx, dy), flags, text)
        painter.setPen(colour)
        painter.drawText(rect, flags, text)

    def _paint_ruler(self, painter: QPainter) -> None:
        assert self.ruler is not None
        a, b = (self.to_widget(*p) for p in self.ruler)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        painter.setPen(QPen(_HALO, 3))
        painter.drawLine(a, b)
        painter.setPen(QPen(_RULER, 1.5))
        painter.drawLine(a, b)
        for end in (a, b):
            painter.drawEllipse(end, 3, 3)
        label = QRectF(b.x() + 6, b.y() - 8, 120, 18)
        self._halo_text(painter, label, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                        self.ruler_text(), _RULER)

    def _paint_text(self, painter: QPainter) -> None:
        font = QFont(self.font())
        font.setBold(True)
        painter.setFont(font)
        r = self.rect().adjusted(6, 4, -6, -4)
        if self._markers is not None:
            top, bottom, left, right = self._markers
            for flags, text in ((Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop, top),
                                (Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignBottom, bottom),
                                (Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, left),
                                (Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, right)):
                self._halo_text(painter, r, flags, text, _MARKER)
        if self._caption:
            self._halo_text(painter, r, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop, self._caption,
                            QColor(230, 230, 230))

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
        self.activated.emit()
        self._last = event.position()
        button = event.button()
        shift = bool(event.modifiers() & Qt.KeyboardModifier.ShiftModifier)
        pixel = self.to_pixel(event.position())
        if self.measuring and button == Qt.MouseButton.LeftButton and not shift and pixel is not None:
            self._drag_mode = "measure"
            self.ruler = (pixel, pixel)
            self.update()
        elif button == Qt.MouseButton.RightButton:
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
        pixel = self.to_pixel(pos)
        self.hovered.emit(*(pixel if pixel is not None else (-1.0, -1.0)))
        if self._drag_mode == "measure" and self.ruler is not None:
            rect = self.image_rect()
            inside = QPointF(min(max(pos.x(), rect.left()), rect.right() - 1e-6),
                             min(max(pos.y(), rect.top()), rect.bottom() - 1e-6))
            end = self.to_pixel(inside)
            if end is not None:
                self.ruler = (self.ruler[0], end)
                self.update()
        elif self._drag_mode == "window":
            self.window_dragged.emit(delta.x(), delta.y())
        elif self._drag_mode == "pan":
            self.pan_requested.emit(delta.x(), delta.y())
        elif self._drag_mode == "point":
            self._emit_point(pos)

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        self._drag_mode, self._drag_button = "", None

    def mouseDoubleClickEvent(self, event: QMouseEvent) -> None:
        self.fit_requested.emit()

    def enterEvent(self, event: QEnterEvent) -> None:
        self.activated.emit()
        super().enterEvent(event)

    def leaveEvent(self, event: QEvent) -> None:
        self.hovered.emit(-1.0, -1.0)
        super().leaveEvent(event)

    def _emit_point(self, pos: QPointF) -> None:
        pixel = self.to_pixel(pos)
        if pixel is not None:
            self.point_requested.emit(*pixel)
