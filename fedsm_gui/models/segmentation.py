"""State of the segmentation panel: bundle, gamma, device, run progress and the routed result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsm_gui.models.signal import Signal

#: Panel states, in the order a session goes through them.
NO_MODEL, READY, RUNNING, DONE = "no-model", "ready", "running", "done"


def routing_rule(metadata: dict[str, Any] | None) -> str | None:
    """Which rule picks a bundle's model for an image: ``"gamma"`` (the selector above gamma),
    ``"style"`` (the site whose images are most alike; gamma changes nothing), ``"argmax"``
    (FedSM-extra) or ``"none"`` (a single-model bundle); ``None`` without a bundle."""
    if not metadata:
        return None
    routing = metadata.get("routing", "gamma")
    return "style" if routing == "gamma" and metadata.get("site_routing") == "style" else routing


#: Words beside the disabled gamma slider, per rule that gamma does not change.
_GAMMA_NOT_USED = {None: "no super model", "style": "style routing", "argmax": "argmax routing", "none": "one model"}


@dataclass(frozen=True)
class SliceRouting:
    """Which model segmented one image or slice, and how sure the selector was."""

    index: int
    model: str
    confidence: float
    probabilities: dict[str, float]
    runner_up: str | None
    reason: str = ""


def routing_from_record(record: Any) -> SliceRouting:
    """A :class:`SliceRouting` from one of ``segment_study``'s per-image records (object or dict)."""
    def get(name: str, default: Any = None) -> Any:
        return record.get(name, default) if isinstance(record, dict) else getattr(record, name, default)

    return SliceRouting(int(get("index")), str(get("model")), float(get("confidence")),
                        {str(k): float(v) for k, v in dict(get("probabilities") or {}).items()}, get("runner_up"),
                        str(get("reason", "") or ""))


class SegmentationState:
    """Qt-free state of the segmentation panel.

    Signals
    -------
    changed()
        Bundle, gamma, device, status, progress or result changed.
    """

    def __init__(self) -> None:
        self.bundle_path: Path | None = None
        self.metadata: dict[str, Any] | None = None
        self.gamma: float | None = None
        self.device: dict[str, str] | None = None
        self.status = NO_MODEL
        self.progress: tuple[int, int] = (0, 0)
        self.message = ""
        self.result: Any = None
        self.routing: list[SliceRouting] = []
        self.forced_model: str | None = None
        self.changed = Signal()

    # --- bundle --------------------------------------------------------------------------
    def set_bundle(self, path: Path, metadata: dict[str, Any]) -> None:
        """A super model is loaded: its gamma becomes the slider's value."""
        self.bundle_path = Path(path)
        self.metadata = dict(metadata)
        self.gamma = float(metadata.get("gamma") or 0.5)
        self.status = READY
        self.message = ""
        # a split-network (BlackFed) bundle has no selector: one site's client net must be chosen
        self.forced_model = self.model_names[0] if self.chooses_site and self.model_names else None
        self.changed.emit()

    @property
    def chooses_site(self) -> bool:
        """Whether the bundle is a split network (BlackFed): the user picks whose client net segments."""
        return bool(self.metadata) and self.metadata.get("routing") == "site"  # type: ignore[union-attr]

    @property
    def model_names(self) -> list[str]:
        """``["global", site1, ...]`` of the loaded bundle (empty without one)."""
        if not self.metadata:
            return []
        if self.metadata.get("routing") == "none":  # single-model bundle (FedAvg, FedProx, Scaffold)
            return ["global"]
        if self.chooses_site:
            return list(self.metadata.get("site_names", []))
        return ["global", *self.metadata.get("site_names", [])]

    @property
    def uses_gamma(self) -> bool:
        """Whether gamma changes routing (FedSM bundles that route by the selector)."""
        return self.gamma_not_used is None

    @property
    def gamma_not_used(self) -> str | None:
        """Why gamma does not change the loaded bundle's routing (:func:`routing_rule`), in the words
        shown beside the disabled slider; ``None`` where it does."""
        rule = routing_rule(self.metadata)
        return None if rule == "gamma" else _GAMMA_NOT_USED.get(rule, f"{rule} routing")

    def set_gamma(self, gamma: float) -> None:
        """Routing threshold for the next run, 0..1."""
        self.gamma = min(max(float(gamma), 0.0), 1.0)
        self.changed.emit()

    def set_forced_model(self, model: str | None) -> None:
        """Segment every slice with ``model`` (``None`` = route with the selector)."""
        if model is not None and model not in self.model_names:
            raise ValueError(f"unknown model {model!r}; the bundle has {self.model_names}")
        if model is None and self.chooses_site:
            raise ValueError("a split-network (BlackFed) bundle needs a site's client net; choose a site")
        self.forced_model = model
        self.changed.emit()

    def set_device(self, device: dict[str, str]) -> None:
        """Where inference runs and why (``{"device", "reason"}``)."""
        self.device = dict(device)
        self.changed.emit()

    # --- run -----------------------------------------------------------------------------
    def start(self) -> None:
        """A run started."""
        self.status = RUNNING
        self.progress = (0, 0)
        self.message = ""
        self.changed.emit()

    def set_progress(self, done: int, total: int) -> None:
        """Steps done of ``total`` in the running job."""
        self.progress = (int(done), int(total))
        self.changed.emit()

    def finish(self, result: Any) -> None:
        """A run finished with ``result`` (a ``StudySegmentation``)."""
        self.result = result
        self.routing = [routing_from_record(r) for r in result.records]
        self.status = DONE
        self.message = ""
        self.changed.emit()

    def fail(self, message: str) -> None:
        """A run or load failed (or was cancelled): keep any earlier result, show ``message``."""
        self.status = DONE if self.result is not None else (READY if self.metadata else NO_MODEL)
        self.message = message
        self.changed.emit()

    def clear_result(self) -> None:
        """Forget the result (a new study was opened)."""
        self.result = None
        self.routing = []
        if self.status == DONE:
            self.status = READY
        self.changed.emit()

    def routing_at(self, index: int) -> SliceRouting | None:
        """Routing of image/slice ``index`` of the last run, if any."""
        if 0 <= index < len(self.routing):
            return self.routing[index]
        return None
