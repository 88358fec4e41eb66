"""Desktop-app responsiveness, measured in one run (offscreen unless ``--show``).

1. **Slice change to repainted view**: median (and 95th percentile) time from a slice step in
   the axial view of a 512 x 512 volume with a label overlay to the end of that view's repaint,
   and to all three views repainted (the other two move their crosshair). Target <= 16 ms.
2. **Longest event-loop stall** while (a) a volume is segmented by a super model in the app's
   worker thread and (b) a site trains (the simulated demo site as a child process, its events
   parsed and drawn by the panel). A 5 ms ``QTimer`` heartbeat runs on the GUI thread; the stall is
   the longest gap between two beats. Target <= 100 ms. Loading the super model beforehand is
   reported too: its first load imports MONAI in the worker, and an import holds Python's GIL.
   And (c) while a 512 x 512 x 300 NIfTI file is opened (reading, display copies, window presets).

Usage::

    python benchmarks/gui_latency.py [--size 512] [--slices 32] [--repeats 200] [--cache-dir DIR]

The super model for (2a) is a small prostate FedSM bundle trained here once (``fedsm simulate``
with 3 sites, 1 round, 32 px) and cached in ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic_volume(size: int, slices: int) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic prostate MR volume and its label at ``size`` x ``size`` x ``slices``."""
    from engine.data.synth import render_prostate, site_profiles

    rng = np.random.default_rng([0, 0, 7, 0])
    volume, label, _ = render_prostate(rng, site_profiles("prostate", 3)[0], size, slices)
    return volume.astype(np.float32), label.astype(np.uint8)


class Heartbeat:
    """A 5 ms QTimer on the GUI thread; :attr:`max_gap_ms` is the longest time between beats."""

    def __init__(self, interval_ms: int = 5) -> None:
        from PySide6.QtCore import Qt, QTimer

        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(interval_ms)
        self.timer.timeout.connect(self._beat)
        self.beats: list[float] = []

    def _beat(self) -> None:
        self.beats.append(time.perf_counter())

    def start(self) -> None:
        self.beats = [time.perf_counter()]
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
        self._beat()

    @property
    def max_gap_ms(self) -> float:
        return 1000 * max(b - a for a, b in zip(self.beats, self.beats[1:], strict=False))

    @property
    def max_gap_at_s(self) -> float:
        """Seconds after start at which the longest gap began."""
        gaps = [(b - a, a) for a, b in zip(self.beats, self.beats[1:], strict=False)]
        return max(gaps)[1] - self.beats[0]


def run_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Run the Qt event loop until ``condition()`` holds (checked every 20 ms) or the timeout."""
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    deadline = time.monotonic() + timeout_s
    poll = QTimer()
    poll.setInterval(20)
    poll.timeout.connect(lambda: loop.quit() if condition() or time.monotonic() > deadline else None)
    poll.start()
    if not condition():
        loop.exec()
    poll.stop()
    return condition()


def slice_latency(app, qt_app, size: int, slices: int, repeats: int) -> dict[str, float]:
    from engine.io.study import LabelMap, Study

    volume, label = synthetic_volume(size, slices)
    spacing = (128.0 / size, 128.0 / size, 3.0)
    study = Study(volume, "volume", np.diag([*spacing, 1.0]), spacing, modality="MR", source=Path("bench.nii.gz"))
    app.studies.show_study(study)
    app.overlays.set_layer("model", LabelMap(label, {1: "prostate"}))
    qt_app.processEvents()
    canvas = app.window.viewer.canvas("axial")
    one_view, all_views = [], []
    step = 1
    for i in range(repeats):
        if not 0 < app.viewer_state.slice_index("axial") + step < slices - 1:
            step = -step
        t0 = time.perf_counter()
        app.viewer.step_slice("axial", step)
        canvas.repaint()
        t1 = time.perf_counter()
        qt_app.processEvents()  # the coronal and sagittal views repaint their crosshair
        t2 = time.perf_counter()
        if i >= 5:  # the first steps warm caches and allocators
            one_view.append(1000 * (t1 - t0))
            all_views.append(1000 * (t2 - t0))
    assert canvas._overlays, "the overlay must be drawn in every measured repaint"
    return {"median_ms": statistics.median(one_view), "p95_ms": float(np.percentile(one_view, 95)),
            "all_views_median_ms": statistics.median(all_views), "canvas": f"{canvas.width()}x{canvas.height()}"}


def prostate_bundle(cache_dir: Path) -> Path:
    import engine.api

    bundle = cache_dir / "prostate-bundle" / "supermodel.safetensors"
    if not bundle.exists():
        print("training a small prostate super model for the benchmark (cached) ...", flush=True)
        engine.api.simulate(cache_dir / "prostate-bundle", task="prostate", sites=3, rounds=1, image_size=32,
                            methods=["fedsm"], epochs=1, data_dir=str(cache_dir / "prostate-data"))
    return bundle


def loading_stall(app, bundle: Path) -> dict[str, float]:
    """Stall while a bundle is loaded in the worker (the first load imports MONAI, builds the networks)."""
    beat = Heartbeat()
    beat.start()
    t0 = time.perf_counter()
    app.segmentation.load_bundle(bundle)
    if not run_until(lambda: app.segmentation_state.metadata is not None, 120):
        raise RuntimeError(f"could not load {bundle}: {app.window.banner.label.text()}")
    beat.stop()
    return {"max_stall_ms": beat.max_gap_ms, "wall_s": time.perf_counter() - t0}


def segmentation_stall(app) -> dict[str, float]:
    beat = Heartbeat()
    beat.start()
    t0 = time.perf_counter()
    app.segmentation.run()
    run_until(lambda: app.segmentation_state.status != "running", 600)
    wall = time.perf_counter() - t0
    beat.stop()
    if app.segmentation_state.status != "done" or app.segmentation_state.message:
        raise RuntimeError(f"segmentation failed: {app.segmentation_state.message}")
    return {"max_stall_ms": beat.max_gap_ms, "at_s": beat.max_gap_at_s, "wall_s": wall, "beats": len(beat.beats),
            "slices": len(app.segmentation_state.routing)}


def training_stall(app, seconds: float) -> dict[str, float]:
    beat = Heartbeat()
    beat.start()
    t0 = time.perf_counter()
    app.federation.join()
    state = app.federation_state
    run_until(lambda: state.status in ("finished", "failed") or time.perf_counter() - t0 > seconds, seconds + 60)
    beat.stop()
    rounds_done = len(state.metrics)
    app.federation.leave()
    run_until(lambda: not app.process.running, 30)
    if state.status == "failed":
        raise RuntimeError(f"demo site failed: {state.error}")
    return {"max_stall_ms": beat.max_gap_ms, "wall_s": time.perf_counter() - t0,
            "events_logged": state.log_total, "rounds_with_metrics": rounds_done}


def opening_stall(app, size: int, slices: int, cache_dir: Path) -> dict[str, float]:
    """Stall while a ``size x size x slices`` int16 NIfTI file is opened (read, canonical order,
    display copies and window presets all in the worker)."""
    import nibabel as nib

    path = cache_dir / f"open-{size}x{size}x{slices}.nii"
    if not path.exists():
        rng = np.random.default_rng(0)
        volume = rng.integers(0, 2000, (size, size, slices), dtype=np.int16)
        nib.save(nib.Nifti1Image(volume, np.diag([0.7, 0.7, 1.5, 1.0])), path)
    opened: list[object] = []
    beat = Heartbeat()
    beat.start()
    t0 = time.perf_counter()
    app.studies.open_path(path, then=opened.append)
    if not run_until(lambda: bool(opened), 300):
        raise RuntimeError(f"could not open {path}: {app.window.banner.label.text()}")
    wall = time.perf_counter() - t0
    beat.stop()
    return {"max_stall_ms": beat.max_gap_ms, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--slices", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--open-slices", type=int, default=300, help="slices of the volume file opened at the end")
    parser.add_argument("--site-seconds", type=float, default=40.0, help="how long to watch the training site")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "fedsm-gui-bench")
    parser.add_argument("--show", action="store_true", help="use the real display instead of offscreen")
    args = parser.parse_args(argv)
    if not args.show:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtWidgets import QApplication

    from fedsm_gui.app import FedSMApp

    qt_app = QApplication.instance() or QApplication([])
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    app = FedSMApp(None, demo_workdir=args.cache_dir / "site", demo_rounds=3)
    app.window.resize(1400, 860)
    app.window.show()
    qt_app.processEvents()
    print(f"machine: {os.cpu_count()} CPUs, platform {qt_app.platformName()}")

    lat = slice_latency(app, qt_app, args.size, args.slices, args.repeats)
    print(f"slice change -> repainted axial view with overlay ({args.size}x{args.size}, canvas {lat['canvas']}): "
          f"median {lat['median_ms']:.2f} ms, p95 {lat['p95_ms']:.2f} ms (target <= 16 ms); "
          f"all three views: median {lat['all_views_median_ms']:.2f} ms")

    load = loading_stall(app, prostate_bundle(args.cache_dir))
    print(f"loading the super model ({load['wall_s']:.1f} s in the worker, first load imports MONAI): "
          f"longest event-loop stall {load['max_stall_ms']:.1f} ms")
    seg = segmentation_stall(app)
    print(f"segmenting a {args.size}x{args.size}x{args.slices} volume ({seg['slices']} slices, "
          f"{seg['wall_s']:.1f} s in the worker): longest event-loop stall {seg['max_stall_ms']:.1f} ms "
          f"at {seg['at_s']:.1f} s "
          f"(target <= 100 ms)")

    site = training_stall(app, args.site_seconds)
    print(f"site training (demo site process, {site['wall_s']:.0f} s watched, {site['rounds_with_metrics']} rounds, "
          f"{site['events_logged']} log lines): longest event-loop stall {site['max_stall_ms']:.1f} ms "
          f"(target <= 100 ms)")
    opening = opening_stall(app, args.size, args.open_slices, args.cache_dir)
    print(f"opening a {args.size}x{args.size}x{args.open_slices} NIfTI file ({opening['wall_s']:.1f} s in the "
          f"worker): longest event-loop stall {opening['max_stall_ms']:.1f} ms (target <= 100 ms)")
    app.shutdown()
    app.window.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
