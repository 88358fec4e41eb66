"""Segmentation panel: super model, gamma, device, Run/Cancel, routing strip, compare, CDR, export."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from fedsm_gui.models.segmentation import routing_rule
from fedsm_gui.views.confidence_strip import ConfidenceStrip, model_colour

#: Export formats the save dialog may offer (the engine picks the writer from the suffix).
_FILTER_NIFTI, _FILTER_PNG, _FILTER_SEG = "NIfTI (*.nii.gz)", "PNG label map (*.png)", "DICOM SEG (*.dcm)"


def export_filters(proposed_name: str) -> str:
    """The save dialog's formats for the open study, the proposed name's format first.

    A photo exports as PNG or NIfTI, a DICOM series as DICOM SEG or NIfTI, other volumes as
    NIfTI: DICOM SEG needs the source series, PNG a 2D image.
    """
    name = proposed_name.lower()
    if name.endswith(".png"):
        return ";;".join((_FILTER_PNG, _FILTER_NIFTI))
    if name.endswith(".dcm"):
        return ";;".join((_FILTER_SEG, _FILTER_NIFTI))
    return _FILTER_NIFTI


def _fmt_number(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, int | float) else "?"


def _fmt_dice(value: Any) -> str:
    return "—" if value is None else f"{float(value):.3f}"


def _distilled_text(metadata: dict[str, Any], extra: dict[str, Any]) -> str:
    """A single distilled model (FedIOD): no routing; the privacy budget each site spent."""
    eps = extra.get("epsilon") or {}
    dice = metadata.get("val_dice", {}) or {}
    rows = "".join(
        f"<tr><td>{site}</td><td align='right'>{_fmt_dice(dice.get(site))}</td>"
        f"<td align='right'>{'no DP' if eps.get(site) is None else f'ε {float(eps[site]):.3g}'}</td></tr>"
        for site in metadata.get("site_names", []))
    return (f"<b>{metadata.get('task', '?')}</b> · distilled ({metadata.get('method', '?')}) · one model, "
            f"no routing · taught by {len(metadata.get('site_names', []))} sites"
            f"<br>labels: {', '.join(metadata.get('label_names', []))}"
            f"<table><tr><th align='left'>site</th><th>validation Dice</th><th>privacy</th></tr>{rows}</table>")


class SegmentationPanel(QGroupBox):
    """Concrete :class:`~fedsm_gui.views.bases.SegmentationView`."""

    load_bundle_requested = Signal(str)
    gamma_changed = Signal(float)
    run_requested = Signal()
    cancel_requested = Signal()
    force_model_requested = Signal(str)
    compare_requested = Signal(str)
    export_requested = Signal(str)
    keep_names_changed = Signal(bool)
    strip_slice_requested = Signal(int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Segmentation (FedSM super model)", parent)
        self.load_button = QPushButton("Load super model…")
        self.load_button.clicked.connect(self.browse_bundle)
        self.bundle_label = QLabel()
        self.bundle_label.setObjectName("bundle-label")
        self.bundle_label.setWordWrap(True)
        self.metadata_label = QLabel()
        self.metadata_label.setObjectName("bundle-metadata")
        self.metadata_label.setWordWrap(True)
        self.metadata_label.setTextFormat(Qt.TextFormat.RichText)

        self.gamma = QSlider(Qt.Orientation.Horizontal)
        self.gamma.setObjectName("gamma-slider")
        self.gamma.setRange(0, 100)
        self.gamma.valueChanged.connect(lambda v: self.gamma_changed.emit(v / 100.0))
        self.gamma_label = QLabel("γ —")
        self.device_label = QLabel("device: —")
        self.device_label.setObjectName("device-label")
        self.device_label.setWordWrap(True)
        self.model_combo = QComboBox()
        self.model_combo.setObjectName("force-model")
        self.model_combo.activated.connect(self._forced)

        self.run_button = QPushButton("Run")
        self.run_button.setObjectName("run-button")
        self.run_button.clicked.connect(self.run_requested)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setObjectName("cancel-button")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.progress = QProgressBar()
        self.progress.setObjectName("segmentation-progress")
        self.status_label = QLabel()
        self.status_label.setObjectName("segmentation-status")
        self.status_label.setWordWrap(True)

        self.strip = ConfidenceStrip()
        self.strip.slice_clicked.connect(self.strip_slice_requested)
        self.current_label = QLabel("")
        self.current_label.setObjectName("current-routing")
        self.current_label.setWordWrap(True)
        self.current_label.setTextFormat(Qt.TextFormat.RichText)
        self.compare_button = QPushButton("Compare with runner-up")
        self.compare_button.setObjectName("compare-button")
        self.compare_button.clicked.connect(lambda: self.compare_requested.emit(""))
        self.cdr_label = QLabel("")
        self.cdr_label.setObjectName("cdr-label")
        self.cdr_label.setWordWrap(True)
        self.export_button = QPushButton("Export mask…")
        self.export_button.setObjectName("export-button")
        self.export_button.clicked.connect(self.browse_export)
        # Off by default: image file names often name patients, and a mask named after one carries it along.
        self.keep_names_box = QCheckBox("Name the mask after the image file")
        self.keep_names_box.setObjectName("keep-names")
        self.keep_names_box.setToolTip("Off: the export dialog proposes a neutral name, case- and a hash of the image "
                                       "file's content (the same every time). On: the image file's own name, which "
                                       "may name the patient.")
        self.keep_names_box.toggled.connect(self.keep_names_changed)

        gamma_row = QHBoxLayout()
        gamma_row.addWidget(self.gamma, 1)
        gamma_row.addWidget(self.gamma_label)
        run_row = QHBoxLayout()
        run_row.addWidget(self.run_button)
        run_row.addWidget(self.cancel_button)
        run_row.addWidget(self.progress, 1)
        form = QFormLayout()
        form.addRow("Gamma", gamma_row)
        form.addRow("Model", self.model_combo)
        layout = QVBoxLayout(self)
        top = QHBoxLayout()
        top.addWidget(self.load_button)
        top.addWidget(self.bundle_label, 1)
        layout.addLayout(top)
        layout.addWidget(self.metadata_label)
        layout.addLayout(form)
        layout.addWidget(self.device_label)
        layout.addLayout(run_row)
        layout.addWidget(self.status_label)
        self.routing_title = QLabel()
        self.routing_title.setObjectName("routing-title")
        layout.addWidget(self.routing_title)
        layout.addWidget(self.strip)
        layout.addWidget(self.current_label)
        bottom = QHBoxLayout()
        bottom.addWidget(self.compare_button)
        bottom.addWidget(self.export_button)
        layout.addLayout(bottom)
        layout.addWidget(self.keep_names_box)
        layout.addWidget(self.cdr_label)
        layout.addStretch(1)
        self._gamma_value: float | None = None
        self._export_name = "mask.nii.gz"
        self._metadata: dict[str, Any] | None = None
        self._bundle_path: str | None = None
        self._photo = False
        self.set_photo(False)

    # --- dialogs -------------------------------------------------------------------------
    def browse_bundle(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Load super model", "", "FedSM bundle (*.safetensors)")
        if path:
            self.load_bundle_requested.emit(path)

    def browse_export(self) -> None:
        path, chosen = QFileDialog.getSaveFileName(self, "Export mask", self._export_name,
                                                   export_filters(self._export_name))
        if path:
            suffix = {"NIfTI": ".nii.gz", "PNG": ".png", "DICOM": ".dcm"}
            for key, ext in suffix.items():
                if chosen.startswith(key) and not path.lower().endswith(ext):
                    path += ext
            self.export_requested.emit(path)

    def _forced(self, index: int) -> None:
        self.force_model_requested.emit(self.model_combo.itemData(index) or "")

    # --- SegmentationView ----------------------------------------------------------------
    def provenance_html(self) -> str:
        """Where the loaded super model comes from (for Help ▸ About); ``""`` when none is loaded."""
        meta, path = self._metadata, self._bundle_path
        if meta is None:
            return ""
        extra = meta.get("extra") or {}
        seed = f", seed {extra['seed']}" if "seed" in extra else ""
        return (f"{Path(path).name if path else '?'} — {meta.get('method', '?')}{_rule_words(meta)} on "
                f"{meta.get('task', '?')}, "
                f"{len(meta.get('site_names', []))} sites ({', '.join(meta.get('site_names', []))}), "
                f"{meta.get('rounds', '?')} rounds{seed}; written {meta.get('created', '?')} by FedSM engine "
                f"{meta.get('engine_version', '?')}<br><small>{path or ''}</small>")

    def set_metadata(self, path: str | None, metadata: dict[str, Any] | None, message: str = "") -> None:
        self._metadata, self._bundle_path = metadata, path
        if metadata is None:
            self.bundle_label.setText("")
            self.metadata_label.setText(f"<i>{message}</i>".replace("\n", "<br>"))
            return
        self.bundle_label.setText(Path(path).name if path else "")
        self.bundle_label.setToolTip(path or "")
        dice = metadata.get("val_dice", {}) or {}
        extra = metadata.get("extra") or {}
        if extra.get("distilled"):
            self.metadata_label.setText(_distilled_text(metadata, extra))
            return
        rows = "".join(f"<tr><td>{site}</td><td align='right'>{_fmt_dice(dice.get(site))}</td></tr>"
                       for site in metadata.get("site_names", []))
        self.metadata_label.setText(
            f"<b>{metadata.get('task', '?')}</b> · {metadata.get('method', '?')} · "
            f"{len(metadata.get('site_names', []))} sites · {metadata.get('rounds', '?')} rounds · "
            f"{_personalization_text(metadata)} · {_routing_text(metadata)}"
            f"<br>labels: {', '.join(metadata.get('label_names', []))}"
            f"<table><tr><th align='left'>site</th><th>validation Dice</th></tr>{rows}</table>")

    def set_gamma(self, gamma: float | None, not_used: str | None) -> None:
        enabled = not_used is None
        self._gamma_value = gamma if enabled else None
        self.gamma.blockSignals(True)
        self.gamma.setValue(round((gamma or 0.0) * 100))
        self.gamma.blockSignals(False)
        self.gamma.setEnabled(enabled)
        self.gamma_label.setText("γ —" if gamma is None else (f"γ {gamma:.2f}" if enabled else not_used))
        self.gamma.setToolTip("" if enabled else f"Gamma does not change this super model's routing ({not_used}).")

    def set_device(self, text: str) -> None:
        self.device_label.setText(f"device: {text}")

    def set_models(self, names: Sequence[str], forced: str | None, choose_site: bool = False) -> None:
        """Fill the model choice; ``choose_site``: a BlackFed bundle, one entry per site's client net."""
        self.model_combo.blockSignals(True)
        self.model_combo.clear()
        if choose_site:
            for name in names:
                self.model_combo.addItem(f"client net of {name} (BlackFed)", name)
        else:
            self.model_combo.addItem("routed by the super model", "")
        for name in names if not choose_site else ():
            label = "global model" if name == "global" else f"personalized model of {name}"
            self.model_combo.addItem(f"force: {label}", name)
        self.model_combo.setCurrentIndex(self.model_combo.findData(forced or ""))
        self.model_combo.blockSignals(False)
        self.model_combo.setEnabled(bool(names))

    def set_run_state(self, status: str, done: int, total: int, message: str, can_run: bool) -> None:
        running = status == "running"
        self.run_button.setEnabled(can_run and not running)
        self.cancel_button.setEnabled(running)
        self.progress.setRange(0, max(total, 1) if (total or not running) else 0)
        self.progress.setValue(done if total else 0)
        text = {"no-model": "", "ready": "Ready: press Run.", "running": "Segmenting…", "done": "Done."}[status]
        self.status_label.setText(message if message else text)
        self.status_label.setStyleSheet("color: #c33;" if message and message != "cancelled" else "")
        self.export_button.setEnabled(status == "done")
        self.compare_button.setEnabled(status == "done")

    def set_routing(self, strip: Sequence[tuple[str, float]], model_names: Sequence[str], current: int) -> None:
        self.strip.set_data(strip, model_names, current, self._gamma_value)

    def set_photo(self, photo: bool) -> None:
        self._photo = bool(photo)
        self.routing_title.setText(f"Routing per {'image' if photo else 'slice'} "
                                   "(colour: model, height: selector confidence)")

    def set_current(self, index: int | None, model: str | None, confidence: float | None,
                    probabilities: dict[str, float], runner_up: str | None, reason: str = "") -> None:
        if index is None or model is None:
            self.current_label.setText("")
            return
        colour = model_colour(model, self.strip.model_names).name()
        probs = " · ".join(f"{k} {v:.2f}" for k, v in sorted(probabilities.items(), key=lambda kv: -kv[1]))
        self.current_label.setText(
            f"{'Image' if self._photo else f'Slice {index + 1}'}: <b style='color:{colour}'>{model}</b> model, "
            f"confidence {confidence:.2f}"
            f"<br>selector: {probs}<br>runner-up: {runner_up or '—'}"
            + (f"<br>why: {html.escape(reason)}" if reason else ""))

    def set_export_name(self, name: str) -> None:
        self._export_name = name

    def set_cup_to_disc(self, model_value: Any, reference_value: Any) -> None:
        parts, doubts = [], []
        for name, ratio in (("model", model_value), ("reference", reference_value)):
            if ratio is None:
                continue
            parts.append(f"{name} {ratio.value:.2f}" + ("" if ratio.trusted else " (not reliable)"))
            if not ratio.trusted:
                doubts.append(f"{name}: {ratio.reason}")
        text = f"Vertical cup-to-disc ratio: {', '.join(parts)}" if parts else ""
        self.cdr_label.setText(text + "".join(f"\n⚠ {d}" for d in doubts))
        self.cdr_label.setStyleSheet("color: #b35900;" if doubts else "")


#: How the desktop app names each personalization rule of a FedSM bundle.
RULE_TITLES = {"softpull": "SoftPull", "apfl": "APFL", "finetune": "local fine-tuning", "perfedavg": "Per-FedAvg",
               "pfedme": "pFedMe"}


def _personalization_text(metadata: dict[str, Any]) -> str:
    """``"SoftPull λ 0.7"`` or the other rule's name: how the bundle's personalized models were trained."""
    rule = metadata.get("personalization", "softpull")
    if metadata.get("method") != "fedsm" or rule == "softpull":
        return f"λ {_fmt_number(metadata.get('lam'))}"
    return f"personalized by {RULE_TITLES.get(rule, rule)}"


def _routing_text(metadata: dict[str, Any]) -> str:
    """How the bundle picks a model: ``"γ 0.6 · routing gamma"`` where the selector and gamma decide, else
    the rule that does (a style-routed bundle's gamma changes nothing, so it is not shown as if it did)."""
    rule = routing_rule(metadata)
    if rule == "style":
        return "routing by site style (gate, then nearest site)"
    if rule == "gamma":
        return f"γ {_fmt_number(metadata.get('gamma'))} · routing gamma"
    return "one model" if rule == "none" else f"routing {rule}"


def _rule_words(metadata: dict[str, Any]) -> str:
    """`` (personalized by APFL)`` for a FedSM bundle whose rule is not SoftPull, else ``""``."""
    rule = metadata.get("personalization", "softpull")
    return "" if metadata.get("method") != "fedsm" or rule == "softpull" else f" ({_personalization_text(metadata)})"
