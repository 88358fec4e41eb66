"""Provenance of an exported mask: which super model made it, and which model segmented what.

Every mask FedSM exports carries one :class:`Provenance` record (as a NIfTI header extension, a
PNG text chunk, DICOM SEG attributes and/or a ``<mask>.provenance.json`` sidecar, see
:mod:`engine.io.export`). It is plain JSON, so any tool can read it::

    {"format": "fedsm-provenance", "format_version": 1,
     "bundle_name": "supermodel.safetensors", "bundle_sha256": "9f2c...",
     "task": "prostate", "method": "fedsm", "routing": "gamma", "gamma": 0.6,
     "engine_version": "0.1.0", "created": "2025-01-01T12:00:00+00:00", "device": "cpu",
     "forced_model": null, "labels": {"1": "prostate"},
     "images": [{"index": 0, "model": "north", "confidence": 0.93,
                 "probabilities": {"north": 0.93, "south": 0.07}, "runner_up": "south"}, ...]}

``images`` has one record per segmented image: the photo itself, or axial slice ``k`` of a
volume (``array[:, :, k]`` in the study's canonical order).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import engine
from engine.errors import DataError
from engine.io.guard import load_json

#: Value of the ``format`` key; anything else is not a FedSM provenance record.
PROVENANCE_FORMAT = "fedsm-provenance"
#: Newest record layout this engine reads and the one it writes.
PROVENANCE_VERSION = 1


def utc_now() -> str:
    """Current time as ISO 8601 UTC, to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


@dataclass(frozen=True)
class ImageRecord:
    """How one image (a photo or one axial slice) was segmented.

    Attributes
    ----------
    index
        0 for a photo; the canonical ``k`` of the slice for a volume.
    model
        Routed model: ``"global"`` or a site's name.
    confidence
        Largest selector probability.
    probabilities
        Selector softmax by name: site names (FedSM) or ``"global"`` plus site names (FedSM-extra).
    runner_up
        Second most probable name, ``None`` when the selector has a single class.
    reason
        Why the image went to ``model``, in words (gamma, routing guard); ``""`` in records
        written before reasons existed.
    """

    index: int
    model: str
    confidence: float
    probabilities: dict[str, float]
    runner_up: str | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return {
            "index": self.index,
            "model": self.model,
            "confidence": self.confidence,
            "probabilities": dict(self.probabilities),
            "runner_up": self.runner_up,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImageRecord:
        """Inverse of :meth:`to_dict`; raises ``KeyError``/``TypeError``/``ValueError`` on bad input."""
        probabilities = data["probabilities"]
        if not isinstance(probabilities, Mapping):
            raise TypeError("probabilities must be an object")
        runner_up = data.get("runner_up")
        return cls(
            index=_integer(data["index"], "index"),
            model=_text(data["model"], "model"),
            confidence=_number(data["confidence"], "confidence"),
            probabilities={_text(k, "probability name"): _number(v, "probability") for k, v in probabilities.items()},
            runner_up=None if runner_up is None else _text(runner_up, "runner_up"),
            reason=_text(data["reason"], "reason") if data.get("reason") else "",
        )


@dataclass(frozen=True)
class Provenance:
    """Where an exported mask came from.

    Attributes
    ----------
    bundle_name
        File name of the super-model bundle (no folders: paths can name people or sites).
    bundle_sha256
        SHA-256 of the bundle file, hex.
    task
        The bundle's task (``"fundus"``, ``"prostate"``).
    method
        ``"fedsm"`` or ``"fedsm-extra"``.
    routing
        ``"gamma"`` (Algorithm 2: the best site's model when its probability exceeds ``gamma``,
        else the global model) or ``"argmax"`` (Algorithm 4: argmax over global + sites).
    gamma
        Threshold used with ``routing == "gamma"``; ``None`` with argmax routing.
    engine_version
        ``engine.__version__`` of the writer.
    created
        ISO 8601 UTC time the segmentation was made.
    device
        Torch device the networks ran on (``"cpu"``, ``"cuda"``, ...).
    forced_model
        Model name every image was sent to instead of routing, ``None`` when routed.
    labels
        Mask value -> structure name.
    images
        One :class:`ImageRecord` per segmented image or slice, in index order.
    """

    bundle_name: str
    bundle_sha256: str
    task: str
    method: str
    routing: str
    gamma: float | None
    engine_version: str = engine.__version__
    created: str = field(default_factory=utc_now)
    device: str = ""
    forced_model: str | None = None
    labels: dict[int, str] = field(default_factory=dict)
    images: tuple[ImageRecord, ...] = ()

    @property
    def models_used(self) -> dict[str, int]:
        """Images per routed model name, sorted by name."""
        counts: dict[str, int] = {}
        for record in self.images:
            counts[record.model] = counts.get(record.model, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """One line for short text fields (DICOM ContentDescription, NIfTI descrip)."""
        rule = f"gamma={self.gamma:g}" if self.gamma is not None else self.routing
        return f"FedSM {self.task} {rule} sha256:{self.bundle_sha256[:12]}"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (label keys become strings, as JSON requires)."""
        return {
            "format": PROVENANCE_FORMAT,
            "format_version": PROVENANCE_VERSION,
            "bundle_name": self.bundle_name,
            "bundle_sha256": self.bundle_sha256,
            "task": self.task,
            "method": self.method,
            "routing": self.routing,
            "gamma": self.gamma,
            "engine_version": self.engine_version,
            "created": self.created,
            "device": self.device,
            "forced_model": self.forced_model,
            "labels": {str(k): v for k, v in sorted(self.labels.items())},
            "images": [r.to_dict() for r in self.images],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """JSON text; raises ``ValueError`` on NaN/Inf (never valid provenance)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any, where: str = "provenance") -> Provenance:
        """Build from :meth:`to_dict`'s output.

        Raises
        ------
        DataError
            When ``data`` is not a FedSM provenance record, is from a newer engine, or a field
            is missing or of the wrong type; the message names ``where``.
        """
        if not isinstance(data, Mapping) or data.get("format") != PROVENANCE_FORMAT:
            raise DataError(f"{where}: not a FedSM provenance record (no \"format\": \"{PROVENANCE_FORMAT}\")")
        version = data.get("format_version")
        if not isinstance(version, int) or version > PROVENANCE_VERSION:
            raise DataError(
                f"{where}: provenance format version {version!r} is not supported (this engine reads up to "
                f"{PROVENANCE_VERSION}); update FedSM"
            )
        try:
            gamma = data["gamma"]
            forced = data.get("forced_model")
            labels = data.get("labels", {})
            if not isinstance(labels, Mapping):
                raise TypeError("labels must be an object")
            images = data.get("images", [])
            if not isinstance(images, list):
                raise TypeError("images must be a list")
            return cls(
                bundle_name=_text(data["bundle_name"], "bundle_name"),
                bundle_sha256=_text(data["bundle_sha256"], "bundle_sha256"),
                task=_text(data["task"], "task"),
                method=_text(data["method"], "method"),
                routing=_text(data["routing"], "routing"),
                gamma=None if gamma is None else _number(gamma, "gamma"),
                engine_version=_text(data["engine_version"], "engine_version"),
                created=_text(data["created"], "created"),
                device=_text(data.get("device", ""), "device"),
                forced_model=None if forced is None else _text(forced, "forced_model"),
                labels={int(k): _text(v, "label name") for k, v in labels.items()},
                images=tuple(ImageRecord.from_dict(r) for r in images),
            )
        except KeyError as exc:
            raise DataError(f"{where}: provenance record lacks the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise DataError(f"{where}: provenance record is malformed ({exc})") from None

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "provenance") -> Provenance:
        """Parse :meth:`to_json`'s output; :class:`DataError` naming ``where`` when it is not."""
        # Nesting bounded: a crafted record (a PNG chunk, a sidecar) cannot hit the recursion limit.
        return cls.from_dict(load_json(text, f"{where}: provenance"), where)


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be text, got {type(value).__name__}")
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    return float(value)
