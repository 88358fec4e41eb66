"""Abstract views: the intents each widget emits and the ``set_*`` methods controllers call.

Qt-free, so controllers are tested with ``MagicMock(spec=SomeView)``. Each concrete widget in
this package declares the same names (intents as Qt ``Signal``\\ s); ``tests/gui`` checks that
every concrete view provides every intent and method of its base.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class Intent:
    """Declares a signal a view emits; its arguments are documented in ``args``.

    Concrete Qt views replace it with a ``Signal`` of the same name; a mock view replaces it
    with a mock whose ``connect`` records the controller's slot.
    """

    def __init__(self, *args: str) -> None:
        self.args = args

    def connect(self, slot: Any) -> None:  # pragma: no cover - replaced in concrete views
        raise NotImplementedError("abstract intent: a concrete view provides the signal")


class ViewerView:
    """The slice views (three orthogonal views of a volume, or one photo)."""

    slice_step_requested = Intent("view: str", "step: int")
    slice_requested = Intent("view: str", "index: int")
    cursor_requested = Intent("view: str", "row: float", "col: float")
    window_drag_requested = Intent("dx: float", "dy: float")
    preset_requested = Intent("name: str")
    zoom_requested = Intent("view: str", "factor: float")
    pan_requested = Intent("view: str", "dx: float", "dy: float")
    fit_requested = Intent()
    photo_adjust_requested = Intent("brightness: float", "contrast: float")
    green_toggled = Intent("on: bool")
    hover_requested = Intent("view: str", "row: float (-1: off the slice)", "col: float")

    def set_views(self, views: Sequence[str], message: str = "") -> None:
        """Show these views (``()``: the empty state with ``message``)."""
        raise NotImplementedError

    def set_slice(self, view: str, image: np.ndarray, overlays: Sequence[np.ndarray],
                  pixel_mm: tuple[float, float], markers: tuple[str, str, str, str] | None,
                  crosshair: tuple[int, int] | None, index: int, count: int) -> None:
        """Draw ``image`` (``uint8`` grey ``(H, W)`` or RGB ``(H, W, 3)``) with RGBA ``overlays``."""
        raise NotImplementedError

    def set_transform(self, view: str, zoom: float, pan_x: float, pan_y: float) -> None:
        """Zoom (1 = fit) and pan (screen pixels) of ``view``."""
        raise NotImplementedError

    def set_window(self, center: float, width: float, presets: Sequence[str]) -> None:
        """Current window/level and the names of the available presets."""
        raise NotImplementedError

    def set_photo_controls(self, brightness: float, contrast: float, green_only: bool) -> None:
        """Current photo adjustment."""
        raise NotImplementedError

    def set_readout(self, text: str) -> None:
        """What lies under the pointer: position, value, label (``""``: nothing)."""
        raise NotImplementedError


class OverlayView:
    """Overlay controls and legend."""

    opacity_changed = Intent("opacity: float")
    outline_toggled = Intent("layer: str", "outline: bool")
    layer_visibility_toggled = Intent("layer: str", "visible: bool")
    label_visibility_toggled = Intent("layer: str", "value: int", "visible: bool")
    label_colour_requested = Intent("layer: str", "value: int")
    visibility_toggled = Intent("visible: bool")

    def set_legend(self, layers: Sequence[dict[str, Any]]) -> None:
        """Layers as ``{"key", "title", "outline", "visible", "labels": [{"value", "name", "colour", "visible"}]}``."""
        raise NotImplementedError

    def set_controls(self, opacity: float, visible: bool) -> None:
        """Opacity slider and show/hide state."""
        raise NotImplementedError

    def choose_colour(self, current: tuple[int, int, int]) -> tuple[int, int, int] | None:
        """Ask the user for a colour (``None`` = cancelled)."""
        raise NotImplementedError


class SegmentationView:
    """The segmentation panel."""

    load_bundle_requested = Intent("path: str")
    gamma_changed = Intent("gamma: float")
    run_requested = Intent()
    cancel_requested = Intent()
    force_model_requested = Intent("model: str ('' = routed)")
    compare_requested = Intent("model: str ('' = runner-up of the current slice)")
    export_requested = Intent("path: str")
    keep_names_changed = Intent("keep: bool (name the exported mask after the image file)")
    strip_slice_requested = Intent("index: int")

    def set_metadata(self, path: str | None, metadata: dict[str, Any] | None, message: str = "") -> None:
        """The loaded bundle's metadata, or the empty state with ``message``."""
        raise NotImplementedError

    def set_gamma(self, gamma: float | None, not_used: str | None) -> None:
        """Gamma slider value; ``not_used``: why gamma does not change routing (slider off), else ``None``."""
        raise NotImplementedError

    def set_device(self, text: str) -> None:
        """Where inference runs (e.g. ``"cpu — no CUDA GPU found"``)."""
        raise NotImplementedError

    def set_models(self, names: Sequence[str], forced: str | None, choose_site: bool = False) -> None:
        """Models that can be forced and the one currently forced (``choose_site``: a BlackFed bundle's sites)."""
        raise NotImplementedError

    def set_run_state(self, status: str, done: int, total: int, message: str, can_run: bool) -> None:
        """Run/Cancel buttons, progress bar and status line."""
        raise NotImplementedError

    def set_routing(self, strip: Sequence[tuple[str, float]], model_names: Sequence[str], current: int) -> None:
        """Confidence strip: per image/slice the routed model and confidence; ``current`` is highlighted."""
        raise NotImplementedError

    def set_photo(self, photo: bool) -> None:
        """Words for the open study: a photo is routed as one *image*, a volume *slice* by slice."""
        raise NotImplementedError

    def set_current(self, index: int | None, model: str | None, confidence: float | None,
                    probabilities: dict[str, float], runner_up: str | None, reason: str = "") -> None:
        """Values of the current image/slice (``None``: no result yet); ``reason``: why this model."""
        raise NotImplementedError

    def set_cup_to_disc(self, model_value: Any, reference_value: Any) -> None:
        """Vertical cup-to-disc ratio of the model's and the reference mask (fundus only).

        Each is ``None`` or an ``engine.api.cup_to_disc_ratio`` result (``value``, ``trusted``,
        ``reason``).
        """
        raise NotImplementedError

    def set_export_name(self, name: str) -> None:
        """File name the export dialog proposes (``case-…_mask.png`` unless the user keeps the image's name)."""
        raise NotImplementedError


class FederationView:
    """The federation panel (site setup, data check, join/leave, live status)."""

    setup_edited = Intent("field: str", "value: str")
    load_config_requested = Intent("path: str")
    save_config_requested = Intent("path: str")
    app_hash_requested = Intent()
    check_data_requested = Intent()
    join_requested = Intent()
    leave_requested = Intent()
    run_confirmation_answered = Intent("accepted: bool")

    def set_setup(self, setup: Any, demo: bool) -> None:
        """Form fields; ``demo`` says Join starts the simulated demo site."""
        raise NotImplementedError

    def set_status(self, status: str, text: str, running: bool) -> None:
        """Connection state, a one-line summary and whether Leave (vs Join) is enabled."""
        raise NotImplementedError

    def ask_run_confirmation(self, summary: str, rows: Sequence[dict[str, Any]]) -> None:
        """Show a run's signed settings (``rows``: setting, value, bound, ok) for Accept / Decline.

        The answer comes back as ``run_confirmation_answered(accepted)``.
        """
        raise NotImplementedError

    def set_progress(self, round_: int, rounds: int, fraction: float, line: str) -> None:
        """Round r of R and the local progress bar: ``fraction`` done (0..1) and the ``line`` it shows."""
        raise NotImplementedError

    def set_metrics(self, rounds: Sequence[Any]) -> None:
        """Per-round loss and validation Dice (:class:`~fedsm_gui.models.federation.RoundMetrics`)."""
        raise NotImplementedError

    def set_ledger(self, entries: Sequence[Any], sent_total: int) -> None:
        """Outbound ledger (:class:`~fedsm_gui.models.federation.LedgerEntry`) and the bytes sent so far."""
        raise NotImplementedError

    def set_log(self, lines: Sequence[str]) -> None:
        """Replace the log view's text."""
        raise NotImplementedError

    def append_log(self, lines: Sequence[str]) -> None:
        """Add lines at the end of the log view."""
        raise NotImplementedError

    def set_check_results(self, rows: Sequence[dict[str, str]], summary: str) -> None:
        """Data check result per file: ``{"file", "status", "message"}``."""
        raise NotImplementedError

    def set_local_app_hash(self, app_hash: str) -> None:
        """Hash of the federated app this installation runs (what the site approves)."""
        raise NotImplementedError


class MainView:
    """The main window: menus, drag and drop, dialogs, messages."""

    open_requested = Intent("path: str")
    open_mask_requested = Intent("path: str")
    overlay_hotkey = Intent()
    retrain_demo_requested = Intent()
    stop_demo_requested = Intent()

    def set_title(self, text: str) -> None:
        """Window title (study name)."""
        raise NotImplementedError

    def set_recent(self, paths: Sequence[str]) -> None:
        """Recent-files menu."""
        raise NotImplementedError

    def choose_series(self, series: Sequence[Any]) -> str | None:
        """Ask which of several DICOM series to open (``SeriesInfo``); return its uid or ``None``."""
        raise NotImplementedError

    def show_error(self, title: str, message: str) -> None:
        """Tell the user something went wrong, in the window (never a traceback)."""
        raise NotImplementedError

    def show_status(self, message: str) -> None:
        """A transient message in the status bar."""
        raise NotImplementedError

    def set_busy(self, message: str | None, done: int = 0, total: int = 0) -> None:
        """Show long work (``None``: hide); ``total == 0`` means an indeterminate bar."""
        raise NotImplementedError

    def set_demo_retraining(self, running: bool) -> None:
        """Whether the demo super model is being retrained (Retrain off, Stop on while it is)."""
        raise NotImplementedError
