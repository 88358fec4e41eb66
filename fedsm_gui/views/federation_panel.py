"""Federation panel: site setup, data check, Join/Leave, live status, plots, ledger and log."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from fedsm_gui.models.federation import MAX_LOG_LINES, describe_contents, format_bytes
from fedsm_gui.views.elided_label import ElidedLabel
from fedsm_gui.views.plot import RoundPlot
from fedsm_gui.views.run_settings_dialog import RunSettingsDialog

#: Form fields: (attribute, label, browse filter or None).
_FIELDS = (
    ("coordinator", "Coordinator address", None),
    ("ca_cert", "CA certificate", "PEM certificate (*.pem *.crt);;All files (*)"),
    ("site_key", "Site key", "Private key (*.pem *.key);;All files (*)"),
    ("site_name", "Site name", None),
    ("datalist", "Datalist", "Datalist (*.json);;All files (*)"),
    ("app_hash", "Approved app hash", None),
    ("dp_epsilon", "Privacy ε (FedIOD)", None),
)
#: What the operator confirms before a BlackFed run may use this site (docs/federation.md, split learning).
SHARE_ACTIVATIONS_WARNING = (
    "BlackFed trains a network split between this site and the coordinator. Unlike FedSM, it sends the "
    "coordinator, for every training batch, the output of this site's first two convolution layers on your "
    "images (activations, from which images can largely be reconstructed) together with the expert masks. "
    "The coordinator never sends weights or gradients back, and your client network stays here.\n\n"
    "Allow split-learning runs on this site's data? (Saved as share_activations = true in site.toml; the site "
    "refuses BlackFed runs without it.)")
_STATUS_COLOURS = {"connected": "#2a2", "starting": "#c90", "reconnecting": "#c90", "finished": "#27c",
                   "failed": "#c33", "disconnected": "#c33"}


class FederationPanel(QWidget):
    """Concrete :class:`~fedsm_gui.views.bases.FederationView`."""

    setup_edited = Signal(str, str)
    load_config_requested = Signal(str)
    save_config_requested = Signal(str)
    app_hash_requested = Signal()
    check_data_requested = Signal()
    join_requested = Signal()
    leave_requested = Signal()
    run_confirmation_answered = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.run_dialog: Any = None  # the open RunSettingsDialog, if any
        # --- setup
        setup = QGroupBox("Site setup")
        form = QFormLayout(setup)
        self.fields: dict[str, QLineEdit] = {}
        # Everything that edits the setup: locked while the site runs (its config is in use).
        self.setup_buttons: list[QPushButton] = []
        for name, label, browse in _FIELDS:
            edit = QLineEdit()
            edit.setObjectName(f"field-{name}")
            edit.textEdited.connect(lambda text, n=name: self.setup_edited.emit(n, text))
            self.fields[name] = edit
            if browse is None:
                form.addRow(label, edit)
                continue
            row = QHBoxLayout()
            row.addWidget(edit, 1)
            button = QPushButton("…")
            button.setFixedWidth(28)
            button.clicked.connect(lambda _=False, n=name, f=browse: self._browse(n, f))
            self.setup_buttons.append(button)
            row.addWidget(button)
            form.addRow(label, row)
        self.task = QComboBox()
        self.task.setObjectName("field-task")
        self.task.addItems(["fundus", "prostate"])
        self.task.textActivated.connect(lambda text: self.setup_edited.emit("task", text))
        form.insertRow(4, "Task", self.task)
        self.fields["app_hash"].setToolTip("SHA-256 of the federated app this site agreed to run; the site "
                                           "refuses any other code")
        self.fields["dp_epsilon"].setToolTip("FedIOD only: the privacy budget (epsilon, delta 1e-5) this site "
                                             "allows for the gradients it releases during a run; empty = no noise. "
                                             "Teacher answers are not covered (docs/architecture.md, FedIOD)")
        self.local_hash = ElidedLabel("")
        self.local_hash.setObjectName("local-app-hash")
        self.use_hash = QPushButton("This installation's app hash…")
        self.use_hash.setToolTip("Show the hash of the federated app this installation runs; compare it with the "
                                 "one the coordinator announces, then approve it")
        self.use_hash.clicked.connect(self._use_local_hash)
        hash_row = QHBoxLayout()
        hash_row.addWidget(self.local_hash, 1)
        hash_row.addWidget(self.use_hash)
        form.addRow("", hash_row)
        self.share_activations = QCheckBox("Allow split-learning runs (BlackFed)")
        self.share_activations.setObjectName("field-share_activations")
        self.share_activations.setToolTip(SHARE_ACTIVATIONS_WARNING)
        self.share_activations.clicked.connect(self._share_activations_clicked)
        self.setup_buttons.append(self.share_activations)  # type: ignore[arg-type]
        form.addRow("", self.share_activations)
        self.config_button = QPushButton("Load site.toml…")
        self.config_button.clicked.connect(self._browse_config)
        self.save_button = QPushButton("Save site.toml…")
        self.save_button.clicked.connect(self._save_config)
        self.setup_buttons += [self.config_button, self.save_button, self.use_hash]
        buttons = QHBoxLayout()
        buttons.addWidget(self.config_button)
        buttons.addWidget(self.save_button)
        buttons.addStretch(1)
        form.addRow(buttons)
        self.mode_label = QLabel()
        self.mode_label.setObjectName("federation-mode")
        self.mode_label.setWordWrap(True)
        form.addRow(self.mode_label)

        # --- data check
        check = QGroupBox("Data check")
        self.check_button = QPushButton("Check data")
        self.check_button.setObjectName("check-data")
        self.check_button.clicked.connect(self.check_data_requested)
        self.check_summary = QLabel()
        self.check_summary.setObjectName("check-summary")
        self.check_summary.setWordWrap(True)
        self.check_table = QTableWidget(0, 3)
        self.check_table.setObjectName("check-table")
        self.check_table.setHorizontalHeaderLabels(["File", "Status", "Message"])
        self.check_table.horizontalHeader().setSectionResizeMode(2, QHeaderView.ResizeMode.Stretch)
        self.check_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        check_layout = QVBoxLayout(check)
        row = QHBoxLayout()
        row.addWidget(self.check_button)
        row.addWidget(self.check_summary, 1)
        check_layout.addLayout(row)
        check_layout.addWidget(self.check_table)

        # --- join / status
        status = QGroupBox("Federation")
        self.join_button = QPushButton("Join")
        self.join_button.setObjectName("join-button")
        self.join_button.clicked.connect(self.join_requested)
        self.leave_button = QPushButton("Leave")
        self.leave_button.setObjectName("leave-button")
        self.leave_button.clicked.connect(self.leave_requested)
        self.status_label = QLabel()
        self.status_label.setObjectName("federation-status")
        self.status_label.setWordWrap(True)
        self.round_label = QLabel("Round — of —")
        self.round_label.setObjectName("round-label")
        self.progress = QProgressBar()
        self.progress.setObjectName("round-progress")
        self.progress.setFormat("")
        status_layout = QVBoxLayout(status)
        row = QHBoxLayout()
        row.addWidget(self.join_button)
        row.addWidget(self.leave_button)
        row.addWidget(self.status_label, 1)
        status_layout.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(self.round_label)
        row.addWidget(self.progress, 1)
        status_layout.addLayout(row)

        # --- plots, ledger, log
        self.loss_plot = RoundPlot("Training loss (mean per round)")
        self.dice_plot = RoundPlot("Validation Dice", y_range=(0.0, 1.0))
        plots = QWidget()
        plots_layout = QHBoxLayout(plots)
        plots_layout.setContentsMargins(0, 0, 0, 0)
        plots_layout.addWidget(self.loss_plot)
        plots_layout.addWidget(self.dice_plot)
        ledger_box = QGroupBox("Traffic ledger: everything this site sent (↑) and received (↓)")
        self.ledger_total = QLabel("sent so far: 0 B")
        self.ledger_total.setObjectName("ledger-total")
        self.ledger = QTableWidget(0, 4)
        self.ledger.setObjectName("ledger-table")
        self.ledger.setHorizontalHeaderLabels(["Round", "Direction", "Bytes", "Contents"])
        self.ledger.horizontalHeader().setSectionResizeMode(3, QHeaderView.ResizeMode.Stretch)
        self.ledger.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        ledger_layout = QVBoxLayout(ledger_box)
        ledger_layout.addWidget(self.ledger_total)
        ledger_layout.addWidget(self.ledger)
        self.log = QPlainTextEdit()
        self.log.setObjectName("federation-log")
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(MAX_LOG_LINES)

        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(0, 0, 0, 0)
        left_layout.addWidget(setup)
        left_layout.addWidget(check, 1)
        right = QSplitter(Qt.Orientation.Vertical)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addWidget(status)
        top_layout.addWidget(plots, 1)
        right.addWidget(top)
        right.addWidget(ledger_box)
        right.addWidget(self.log)
        right.setSizes([380, 200, 160])
        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setSizes([380, 700])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)

    # --- dialogs -------------------------------------------------------------------------
    def _browse(self, field: str, filters: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose file", "", filters)
        if path:
            self.fields[field].setText(path)
            self.setup_edited.emit(field, path)

    def _use_local_hash(self) -> None:
        value = self.use_hash.property("hash")
        if not value:
            self.local_hash.setText("computing …")
            self.app_hash_requested.emit()
            return
        self.fields["app_hash"].setText(value)
        self.setup_edited.emit("app_hash", value)

    def _save_config(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save site configuration", "site.toml", "Site config (*.toml)")
        if path:
            self.save_config_requested.emit(path)

    def _browse_config(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Site configuration", "", "Site config (*.toml)")
        if path:
            self.load_config_requested.emit(path)

    # --- FederationView ------------------------------------------------------------------
    def confirm_share_activations(self) -> bool:
        """Ask the operator to confirm BlackFed's threat model (replaced in tests)."""
        answer = QMessageBox.warning(self, "Activations of your images leave this site", SHARE_ACTIVATIONS_WARNING,
                                     QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
                                     QMessageBox.StandardButton.No)
        return answer == QMessageBox.StandardButton.Yes

    def _share_activations_clicked(self, checked: bool) -> None:
        if checked and not self.confirm_share_activations():
            self.share_activations.setChecked(False)
            return
        self.setup_edited.emit("share_activations", "true" if checked else "false")

    def set_setup(self, setup: Any, demo: bool) -> None:
        self.share_activations.setChecked(bool(getattr(setup, "share_activations", False)))
        for name, edit in self.fields.items():
            edit.setText(str(getattr(setup, name, "")))
        self.task.setCurrentText(setup.task or "fundus")
        if demo:
            self.mode_label.setText("No site configuration yet: fill the form and Save site.toml (or load one). "
                                    "Until then Join starts a simulated site in a small in-process demo federation "
                                    "(synthetic data, nothing leaves this computer).")
        else:
            self.mode_label.setText(f"Join runs the site with {setup.config_path}")

    def ask_run_confirmation(self, summary: str, rows: Sequence[dict[str, Any]]) -> None:
        """Open the run's settings for Accept / Decline (window-modal, so the app keeps running)."""
        if self.run_dialog is not None:  # superseded: closed without answering for the new run
            self.run_dialog.finished.disconnect()
            self.run_dialog.close()
        dialog = RunSettingsDialog(summary, rows, self)
        dialog.finished.connect(
            lambda result: self.run_confirmation_answered.emit(result == RunSettingsDialog.DialogCode.Accepted))
        self.run_dialog = dialog
        dialog.open()

    def set_status(self, status: str, text: str, running: bool) -> None:
        colour = _STATUS_COLOURS.get(status, "#888")
        self.status_label.setText(f"<span style='color:{colour}'>●</span> {text}")
        self.join_button.setEnabled(not running)
        self.leave_button.setEnabled(running)
        for edit in self.fields.values():
            edit.setReadOnly(running)
        self.task.setEnabled(not running)
        for button in self.setup_buttons:
            button.setEnabled(not running)

    def set_progress(self, round_: int, rounds: int, fraction: float, line: str) -> None:
        self.round_label.setText(f"Round {round_ or '—'} of {rounds or '—'}")
        self.progress.setRange(0, 1000)
        self.progress.setValue(round(1000 * min(max(fraction, 0.0), 1.0)))
        self.progress.setFormat(line.replace("%", "%%"))

    def set_metrics(self, rounds: Sequence[Any]) -> None:
        losses: dict[str, list[tuple[int, float]]] = {}
        dice: dict[str, list[tuple[int, float]]] = {}
        for m in rounds:
            for name, value in m.loss.items():
                losses.setdefault(name, []).append((m.round, value))
            for name, value in m.dice.items():
                dice.setdefault(name, []).append((m.round, value))
        self.loss_plot.set_series(losses)
        self.dice_plot.set_series(dice)

    def set_ledger(self, entries: Sequence[Any], sent_total: int) -> None:
        self.ledger.setRowCount(len(entries))
        for row, entry in enumerate(entries):
            arrow = "↑ sent" if entry.direction == "sent" else "↓ received"
            values = (str(entry.round), arrow, format_bytes(entry.bytes),
                      describe_contents(entry.direction, entry.contents))
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                if col == 2:
                    item.setToolTip(f"{entry.bytes:,} bytes")
                self.ledger.setItem(row, col, item)
        if entries:
            self.ledger.scrollToBottom()
        self.ledger_total.setText(f"sent so far: {format_bytes(sent_total)} ({sent_total:,} bytes) — weights, "
                                  "sample counts and metric values only; no images, no labels")

    def set_log(self, lines: Sequence[str]) -> None:
        self.log.setPlainText("\n".join(lines))
        self.log.verticalScrollBar().setValue(self.log.verticalScrollBar().maximum())

    def append_log(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.log.appendPlainText(line)

    def set_local_app_hash(self, app_hash: str) -> None:
        known = app_hash.startswith("sha256:")
        self.local_hash.setText(f"this installation's app: {app_hash}")
        self.use_hash.setProperty("hash", app_hash if known else "")
        self.use_hash.setText("Approve it" if known else "This installation's app hash…")

    def set_check_results(self, rows: Sequence[dict[str, str]], summary: str) -> None:
        self.check_summary.setText(summary)
        self.check_table.setRowCount(len(rows))
        for r, row in enumerate(rows):
            for c, key in enumerate(("file", "status", "message")):
                self.check_table.setItem(r, c, QTableWidgetItem(row.get(key, "")))
