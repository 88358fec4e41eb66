"""The main window: viewer tab (viewer + overlay and segmentation panels), federation tab, menus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from fedsm_gui.views.federation_panel import FederationPanel
from fedsm_gui.views.overlay_panel import OverlayPanel
from fedsm_gui.views.segmentation_panel import SegmentationPanel
from fedsm_gui.views.viewer import ViewerWidget

IMAGE_FILTERS = ("Studies (*.png *.jpg *.jpeg *.tif *.tiff *.bmp *.nii *.nii.gz *.mha *.mhd *.nrrd *.nhdr *.dcm);;"
                 "All files (*)")
MASK_FILTERS = "Masks (*.png *.nii *.nii.gz *.mha *.nrrd *.dcm);;All files (*)"


class SeriesDialog(QDialog):
    """Lists the series of a DICOM folder; the user picks one."""

    def __init__(self, series: Sequence[Any], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Choose a series")
        self.list = QListWidget()
        for info in series:
            size = f", {info.size[0]}×{info.size[1]}" if info.size else ""
            item = QListWidgetItem(f"{info.description or '(no description)'} — {info.modality or '?'}, "
                                   f"{info.count} image(s){size}")
            item.setData(Qt.ItemDataRole.UserRole, info.uid)
            item.setToolTip(info.uid)
            self.list.addItem(item)
        self.list.setCurrentRow(0)
        self.list.itemDoubleClicked.connect(self.accept)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Open | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("This folder holds several series. Which one should be opened?"))
        layout.addWidget(self.list)
        layout.addWidget(buttons)

    def chosen_uid(self) -> str | None:
        item = self.list.currentItem()
        return None if item is None else str(item.data(Qt.ItemDataRole.UserRole))


class MessageBanner(QWidget):
    """A dismissible message at the top of the window (errors never open a blocking dialog)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("message-banner")
        self.setStyleSheet("#message-banner { background: #fbe3e3; border: 1px solid #d88; }")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QPushButton("✕")
        close.setFlat(True)
        close.setFixedWidth(24)
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 4, 4, 4)
        layout.addWidget(self.label, 1)
        layout.addWidget(close)
        self.hide()

    def show_message(self, title: str, message: str) -> None:
        self.label.setText(f"<b>{title}</b>: {message}")
        self.show()


class MainWindow(QMainWindow):
    """Concrete :class:`~fedsm_gui.views.bases.MainView`; holds every other view."""

    open_requested = Signal(str)
    open_mask_requested = Signal(str)
    overlay_hotkey = Signal()
    closing = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("FedSM")
        self.setAcceptDrops(True)
        self.viewer = ViewerWidget()
        self.overlay_panel = OverlayPanel()
        self.segmentation_panel = SegmentationPanel()
        self.federation_panel = FederationPanel()
        self.banner = MessageBanner()

        side = QWidget()
        side_layout = QVBoxLayout(side)
        side_layout.setContentsMargins(0, 0, 0, 0)
        side_layout.addWidget(self.segmentation_panel)
        side_layout.addWidget(self.overlay_panel)
        side_layout.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidget(side)
        scroll.setWidgetResizable(True)
        scroll.setMinimumWidth(340)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(self.viewer)
        splitter.addWidget(scroll)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        self.tabs = QTabWidget()
        self.tabs.addTab(splitter, "Viewer")
        self.tabs.addTab(self.federation_panel, "Federation")
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.banner)
        layout.addWidget(self.tabs, 1)
        self.setCentralWidget(central)

        self.busy_label = QLabel()
        self.busy_bar = QProgressBar()
        self.busy_bar.setObjectName("busy-bar")
        self.busy_bar.setMaximumWidth(240)
        self.statusBar().addPermanentWidget(self.busy_label)
        self.statusBar().addPermanentWidget(self.busy_bar)
        self.busy_label.hide()
        self.busy_bar.hide()
        self._build_menus()
        self.resize(1400, 860)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self._action(file_menu, "&Open file…", QKeySequence.StandardKey.Open, self._open_file)
        self._action(file_menu, "Open &DICOM folder…", "Ctrl+D", self._open_folder)
        self._action(file_menu, "Open &mask to compare…", "Ctrl+M", self._open_mask)
        self.recent_menu = file_menu.addMenu("&Recent")
        file_menu.addSeparator()
        self._action(file_menu, "&Load super model…", "Ctrl+L", self.segmentation_panel.browse_bundle)
        self._action(file_menu, "&Export mask…", "Ctrl+E", self.segmentation_panel.browse_export)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        view_menu = self.menuBar().addMenu("&View")
        self._action(view_menu, "&Fit", "F", self.viewer.fit_requested.emit)
        self._action(view_menu, "Show/hide &overlays", "H", self.overlay_hotkey.emit)
        self._action(view_menu, "&Green channel", "G", self.viewer.green.toggle)
        run_menu = self.menuBar().addMenu("&Segmentation")
        self._action(run_menu, "&Run", "Ctrl+R", self.segmentation_panel.run_requested.emit)

    def _action(self, menu: Any, text: str, shortcut: Any, slot: Any) -> QAction:
        action = QAction(text, self)
        action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(lambda _=False: slot())
        menu.addAction(action)
        self.addAction(action)
        return action

    # --- dialogs -------------------------------------------------------------------------
    def _open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open study", "", IMAGE_FILTERS)
        if path:
            self.open_requested.emit(path)

    def _open_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Open DICOM folder")
        if path:
            self.open_requested.emit(path)

    def _open_mask(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open mask to compare", "", MASK_FILTERS)
        if path:
            self.open_mask_requested.emit(path)

    # --- drag and drop -------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        """A dropped study opens; a dropped ``.safetensors`` loads as the super model; with
        Shift held the dropped file opens as a mask to compare."""
        urls = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if not urls:
            return
        path = urls[0]
        if path.endswith(".safetensors"):
            self.segmentation_panel.load_bundle_requested.emit(path)
        elif event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.open_mask_requested.emit(path)
        else:
            self.open_requested.emit(path)
        event.acceptProposedAction()

    # --- MainView ------------------------------------------------------------------------
    def set_title(self, text: str) -> None:
        self.setWindowTitle(f"FedSM — {text}" if text else "FedSM")

    def set_recent(self, paths: Sequence[str]) -> None:
        self.recent_menu.clear()
        for path in paths:
            action = self.recent_menu.addAction(path)
            action.triggered.connect(lambda _=False, p=path: self.open_requested.emit(p))
        self.recent_menu.setEnabled(bool(paths))

    def choose_series(self, series: Sequence[Any]) -> str | None:
        dialog = SeriesDialog(series, self)
        try:
            return dialog.chosen_uid() if dialog.exec() == QDialog.DialogCode.Accepted else None
        finally:
            dialog.deleteLater()

    def show_error(self, title: str, message: str) -> None:
        self.banner.show_message(title, message)
        self.statusBar().showMessage(f"{title}: {message}", 10000)

    def show_status(self, message: str) -> None:
        self.statusBar().showMessage(message, 5000)

    def set_busy(self, message: str | None, done: int = 0, total: int = 0) -> None:
        if message is None:
            self.busy_label.hide()
            self.busy_bar.hide()
            return
        self.busy_label.setText(message)
        self.busy_bar.setRange(0, total if total > 0 else 0)
        self.busy_bar.setValue(done if total > 0 else 0)
        self.busy_label.show()
        self.busy_bar.show()

    # --- lifecycle -----------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        self.closing.emit()
        super().closeEvent(event)
