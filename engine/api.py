"""The engine's public facade: what the CLI and the desktop app call.

Importing this module is cheap (no torch, no MONAI); each call imports what it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import (
    BundleError,
    CancelledError,
    ConfigError,
    DataError,
    DeviceError,
    FedSMError,
    WeightsError,
)

ProgressFn = Callable[[dict[str, Any]], None]

__all__ = [
    "BundleError",
    "CancelledError",
    "ConfigError",
    "DataError",
    "DeviceError",
    "FedSMError",
    "WeightsError",
    "infer",
    "read_bundle_metadata",
    "simulate",
    "synthesize",
]


def synthesize(task: str, sites: int, out_dir: Path, image_size: int = 256, seed: int = 0) -> list[Path]:
    """Write synthetic multi-site data; return each site's datalist path."""
    from engine.data.synth import generate_federation

    return generate_federation(task, sites, Path(out_dir), image_size=image_size, seed=seed)


def simulate(out_dir: Path, progress: ProgressFn | None = None, cancel: Callable[[], bool] | None = None,
             **settings: Any) -> dict[str, Any]:
    """Run ``fedsm simulate`` in-process; ``settings`` are :class:`engine.simulate.SimulationConfig` fields."""
    from engine.simulate import SimulationConfig, run_simulation

    if "methods" in settings:
        settings["methods"] = tuple(settings["methods"])
    return run_simulation(SimulationConfig(**settings), Path(out_dir), progress, cancel)


def infer(model: Path, input_path: Path, out_dir: Path, gamma: float | None = None, device: str = "auto",
          progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Segment an image, a volume or a folder with a super-model bundle; see ``fedsm infer``."""
    from engine.inference.run import infer_path

    return infer_path(Path(model), Path(input_path), Path(out_dir), gamma=gamma, device=device, progress=progress)


def read_bundle_metadata(path: Path) -> dict[str, Any]:
    """A bundle's metadata as a plain dict (sites, rounds, lambda, gamma, validation Dice, ...)."""
    import json

    from engine.bundle import load_bundle

    return json.loads(load_bundle(Path(path)).metadata.to_json())
