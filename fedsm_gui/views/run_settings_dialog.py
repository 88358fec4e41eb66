"""The dialog in which a site's operator accepts or declines a run's signed settings before training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

#: Column titles of the settings table.
COLUMNS = ("Setting", "Value", "This site's bound", "")


class RunSettingsDialog(QDialog):
    """The run's settings, each against the site's bound; Accept trains for the run, Decline refuses it.

    Closing the dialog declines (``rejected``).
    """

    def __init__(self, summary: str, rows: Sequence[dict[str, Any]], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Join this run?")
        layout = QVBoxLayout(self)
        intro = QLabel("The coordinator asks this site to train with these settings. Nothing is trained or sent "
                       "until you accept.\n\n" + summary)
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.table = QTableWidget(len(rows), len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        for r, row in enumerate(rows):
            value = row.get("value")
            cells = (str(row.get("setting", "")), "—" if value is None else str(value), str(row.get("bound", "")),
                     "✓ within" if row.get("ok") else "✗ outside")
            for c, text in enumerate(cells):
                self.table.setItem(r, c, QTableWidgetItem(text))
        layout.addWidget(self.table)
        self.outside = [str(row.get("setting")) for row in rows if not row.get("ok")]
        if self.outside:
            warning = QLabel("Outside this site's bounds: " + ", ".join(self.outside))
            warning.setStyleSheet("color: #c33")
            layout.addWidget(warning)
        buttons = QDialogButtonBox()
        self.accept_button = buttons.addButton("Accept and train", QDialogButtonBox.ButtonRole.AcceptRole)
        self.decline_button = buttons.addButton("Decline", QDialogButtonBox.ButtonRole.RejectRole)
        self.accept_button.setEnabled(not self.outside)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.resize(640, 420)
