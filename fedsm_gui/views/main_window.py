"""The main window: viewer tab (viewer + overlay and segmentation panels), federation tab, menus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QCloseEvent, QDragEnterEvent, QDropEvent, QKeySequence, QShortcut
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

from fedsm_gui import __version__
from fedsm_gui.views.federation_panel import FederationPanel
from fedsm_gui.views.overlay_panel import OverlayPanel
from fedsm_gui.views.segmentation_panel import SegmentationPanel
from fedsm_gui.views.viewer import ViewerWidget

#: Shown in the status bar, the About box and the README.
RESEARCH_NOTICE = "Research use only — not validated for diagnosis"
#: F1: every key and mouse action of the viewer.
HELP_HTML = """
<table cellspacing="4">
<tr><th align="left">Keys</th><th></th></tr>
<tr><td>↑ / ↓, → / ←</td><td>next / previous slice of the active view (the one last clicked or pointed at)</td></tr>
<tr><td>PageUp / PageDown</td><td>5 slices</td></tr>
<tr><td>F</td><td>fit every view</td></tr>
<tr><td>H</td><td>hide / show all overlays</td></tr>
<tr><td>G</td><td>green channel (red-free view of a fundus photo)</td></tr>
<tr><td>D</td><td>distance tool on / off (left-drag draws a ruler)</td></tr>
<tr><td>Ctrl+O, Ctrl+D</td><td>open a file, a DICOM folder</td></tr>
<tr><td>Ctrl+M</td><td>open a mask to compare (reference outlines)</td></tr>
<tr><td>Ctrl+L, Ctrl+R, Ctrl+E</td><td>load a super model, run it, export the mask</td></tr>
<tr><td>Ctrl+Shift+S</td><td>save a screenshot of the views</td></tr>
<tr><td>F1</td><td>this help</td></tr>
<tr><th align="left">Mouse</th><th></th></tr>
<tr><td>wheel</td><td>scroll slices (volumes), zoom (photos)</td></tr>
<tr><td>Ctrl+wheel</td><td>zoom</td></tr>
<tr><td>left click / drag</td><td>move the crosshair (volumes), pan (photos)</td></tr>
<tr><td>middle or Shift+left drag</td><td>pan</td></tr>
<tr><td>right drag</td><td>window/level (volumes), brightness/contrast (photos)</td></tr>
<tr><td>double click</td><td>fit</td></tr>
<tr><td>pointer</td><td>voxel, position (RAS mm), value and label under it, below the views</td></tr>
</table>
"""
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
    retrain_demo_requested = Signal()
    stop_demo_requested = Signal()
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
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.side_scroll = scroll
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
        self.notice = QLabel(RESEARCH_NOTICE)
        self.notice.setObjectName("research-notice")
        self.notice.setStyleSheet("color: #8a5a00;")
        self.statusBar().addPermanentWidget(self.busy_label)
        self.statusBar().addPermanentWidget(self.busy_bar)
        self.statusBar().addPermanentWidget(self.notice)
        self.busy_label.hide()
        self.busy_bar.hide()
        self._build_menus()
        self._build_slice_keys()
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
        self._action(file_menu, "Save &screenshot of the view…", "Ctrl+Shift+S", self._save_screenshot)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", QKeySequence.StandardKey.Quit, self.close)
        view_menu = self.menuBar().addMenu("&View")
        self._action(view_menu, "&Fit", "F", self.viewer.fit_requested.emit)
        self._action(view_menu, "Show/hide &overlays", "H", self.overlay_hotkey.emit)
        self._action(view_menu, "&Green channel", "G", self.viewer.green.toggle)
        self._action(view_menu, "&Measure distance", "D", self.viewer.measure_button.toggle)
        run_menu = self.menuBar().addMenu("&Segmentation")
        self._action(run_menu, "&Run", "Ctrl+R", self.segmentation_panel.run_requested.emit)
        demo_menu = self.menuBar().addMenu("&Demo")
        self.retrain_demo_action = self._action(demo_menu, "&Retrain the demo super model", "",
                                                self.retrain_demo_requested.emit)
        self.retrain_demo_action.setStatusTip("Train the demo's FedSM super model again on its synthetic sites "
                                              "(minutes), then show and cache it")
        self.stop_demo_action = self._action(demo_menu, "&Stop retraining", "", self.stop_demo_requested.emit)
        self.stop_demo_action.setEnabled(False)
        help_menu = self.menuBar().addMenu("&Help")
        self._action(help_menu, "&Keys and mouse", QKeySequence.StandardKey.HelpContents, self.show_help)
        self._action(help_menu, "&About FedSM", "", self.show_about)

    def _action(self, menu: Any, text: str, shortcut: Any, slot: Any) -> QAction:
        action = QAction(text, self)
        action.setShortcut(QKeySequence(shortcut))
        action.triggered.connect(lambda _=False: slot())
        menu.addAction(action)
        self.addAction(action)
        return action

    def _build_slice_keys(self) -> None:
        """Arrow and page keys scroll the active view wherever the focus is in the viewer tab.

        Window-wide shortcuts, so a focused button, slider or combo box (e.g. after pressing Run,
        or the opacity slider) does not swallow them, as in ITK-SNAP and Slicer.
        """
        self.slice_keys: list[QShortcut] = []
        for key, step in ((Qt.Key.Key_Up, 1), (Qt.Key.Key_Down, -1), (Qt.Key.Key_Right, 1), (Qt.Key.Key_Left, -1),
                          (Qt.Key.Key_PageUp, 5), (Qt.Key.Key_PageDown, -5)):
            shortcut = QShortcut(QKeySequence(key), self)
            shortcut.setContext(Qt.ShortcutContext.WindowShortcut)
            shortcut.activated.connect(lambda s=step: self.viewer.step_active(s))
            self.slice_keys.append(shortcut)
        # the federation tab's text fields and tables keep their arrow keys
        self.tabs.currentChanged.connect(lambda index: [k.setEnabled(index == 0) for k in self.slice_keys])

    # --- help ----------------------------------------------------------------------------
    def show_help(self) -> None:
        """F1: the keys and mouse actions (not modal: the viewer stays usable)."""
        self._info_dialog("Keys and mouse", HELP_HTML, "help-dialog")

    def show_about(self) -> None:
        """Version, the loaded super model's provenance, and the research-use notice."""
        bundle = self.segmentation_panel.provenance_html()
        html = (f"<h3>FedSM {__version__}</h3><p>Cross-silo federated medical image segmentation with FedSM "
                "super models (Xu et al., CVPR 2022).</p>"
                f"<p><b>Super model:</b> {bundle or 'none loaded'}</p><p><b>{RESEARCH_NOTICE}</b> Masks and "
                "measurements are produced by a research model and must not be used to diagnose or treat.</p>")
        self._info_dialog("About FedSM", html, "about-dialog", wrap=True)

    def _info_dialog(self, title: str, html: str, name: str, wrap: bool = False) -> QDialog:
        old = self.findChild(QDialog, name)
        if old is not None:
            old.close()
            old.deleteLater()
        dialog = QDialog(self)
        dialog.setObjectName(name)
        dialog.setWindowTitle(title)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        text = QLabel(html)
        text.setObjectName(f"{name}-text")
        text.setTextFormat(Qt.TextFormat.RichText)
        text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        if wrap:
            # a wrapped label's height depends on its width, which a top-level layout does not ask for
            text.setWordWrap(True)
            text.setFixedWidth(540)
            text.setMinimumHeight(text.heightForWidth(540))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(dialog.close)
        layout = QVBoxLayout(dialog)
        layout.addWidget(text)
        layout.addWidget(buttons)
        dialog.adjustSize()
        dialog.show()
        return dialog

    # --- screenshot ----------------------------------------------------------------------
    def save_screenshot(self, path: str) -> str:
        """Save the views as they are on screen (PNG, or the format the suffix names); return the path."""
        target = path if "." in path.rsplit("/", 1)[-1] else path + ".png"
        if not self.viewer.stack.grab().save(target):
            self.show_error("Screenshot not saved", f"{target}: cannot be written; choose another folder or name")
            return ""
        self.show_status(f"Screenshot saved to {target}")
        return target

    def _save_screenshot(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save screenshot", "fedsm_view.png", "PNG image (*.png)")
        if path:
            self.save_screenshot(path)

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
        # A later success makes an earlier error banner stale (status messages report what worked).
        self.banner.hide()
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

    def set_demo_retraining(self, running: bool) -> None:
        self.retrain_demo_action.setEnabled(not running)
        self.stop_demo_action.setEnabled(running)

    # --- lifecycle -----------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        self.closing.emit()
        super().closeEvent(event)
