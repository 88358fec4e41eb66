"""Write the README's screenshots of the desktop app to ``docs/img/`` (offscreen).

- ``demo_first_screen.png``: the window as ``fedsm-gui --demo`` first shows it.
- ``main_window.png``: the embedded demo (``fedsm-gui --demo``, the shipped demo bundle): a synthetic fundus photo with
  the super model's mask, the ground truth as outlines, the routing strip and the cup-to-disc ratio.
- ``volume_view.png``: a synthetic prostate MR volume in three orthogonal views with the model's
  mask and the per-slice routing strip.
- ``federation_panel.png``: the federation panel mid-run (simulated demo site, in round 3 of 4).
- ``help.png``: Help ▸ Keys and mouse (F1).

The photo and volume shots show the pointer readout; the volume shot a distance ruler too.

Usage::

    python benchmarks/screenshots.py [--cache-dir DIR] [--out docs/img]

The demo super model and a small prostate super model are trained on first use (a few minutes
on a laptop CPU) and cached in ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _wait(condition, timeout_s: float, what: str) -> None:
    from gui_latency import run_until

    if not run_until(condition, timeout_s):
        raise RuntimeError(f"timed out waiting for {what}")


def first_screen_shot(app, cache_dir: Path, out: Path) -> None:
    """``demo_first_screen.png``: the window exactly as ``fedsm-gui --demo`` first shows it (no pointer)."""
    _open_demo(app, cache_dir)
    _grab(app, out / "demo_first_screen.png")


def demo_shot(app, cache_dir: Path, out: Path) -> None:
    _open_demo(app, cache_dir)
    _hover_centre(app, "photo", app.overlays.layers["model"].labels.array == 2)  # the readout over the cup
    _grab(app, out / "main_window.png")


def _open_demo(app, cache_dir: Path) -> None:
    ready: list[bool] = []
    app.demo.start(cache_dir / "demo", on_ready=lambda: ready.append(True))
    _wait(lambda: bool(ready) or app.window.banner.isVisible(), 1800, "the demo")
    if not ready:
        raise RuntimeError(app.window.banner.label.text())
    app.window.tabs.setCurrentIndex(0)


def _hover_centre(app, view: str, mask: np.ndarray) -> None:
    """Put the pointer readout on the centre of ``mask`` (a photo mask, or an axial slice of a volume)."""
    rows, cols = np.nonzero(mask)
    if rows.size:
        app.viewer.hover(view, float(rows.mean()), float(cols.mean()))


def volume_shot(app, cache_dir: Path, out: Path) -> None:
    from gui_latency import synthetic_volume

    import engine.api
    from engine.io.study import LabelMap, Study

    bundle = cache_dir / "prostate-screenshot" / "supermodel.safetensors"
    if not bundle.exists():
        print("training a small prostate super model for the screenshot (cached) ...", flush=True)
        engine.api.simulate(bundle.parent, task="prostate", sites=3, rounds=2, image_size=64, epochs=3,
                            methods=["fedsm"], data_dir=str(cache_dir / "prostate-data-64"))
    volume, label = synthetic_volume(256, 24)
    spacing = (0.5, 0.5, 3.0)
    study = Study(volume, "volume", np.diag([*spacing, 1.0]), spacing, modality="MR",
                  source=Path("synthetic_prostate_t2.nii.gz"), source_format="nifti")
    app.studies.show_study(study)
    app.overlays.set_layer("reference", LabelMap(label, {1: "prostate"}), title="reference: ground truth")
    app.segmentation.load_bundle(bundle)
    _wait(lambda: app.segmentation_state.metadata is not None, 300, "the prostate bundle")
    app.segmentation.run()
    _wait(lambda: app.segmentation_state.status != "running", 300, "the segmentation")
    app.viewer_state.set_cursor((128, 124, 12))  # through the gland (RAS: j = 255 - drawn row)
    app.window.tabs.setCurrentIndex(0)
    axial = app.window.viewer.canvas("axial")
    shown = axial._arrays[1][..., 3] > 0 if len(axial._arrays) > 1 else np.zeros((1, 1), bool)
    _hover_centre(app, "axial", shown)
    rows, cols = np.nonzero(shown)
    if rows.size:  # a ruler across the gland, left to right through its centre
        app.window.viewer.measure_button.setChecked(True)
        middle = float(rows.mean())
        axial.ruler = ((middle, float(cols.min())), (middle, float(cols.max()) + 1))
        axial.update()
    _grab(app, out / "volume_view.png")


def help_shot(app, cache_dir: Path, out: Path) -> None:
    from PySide6.QtWidgets import QApplication, QDialog

    app.window.show_help()
    dialog = app.window.findChild(QDialog, "help-dialog")
    for _ in range(5):
        QApplication.processEvents()
    path = out / "help.png"
    if not dialog.grab().save(str(path)):
        raise RuntimeError(f"cannot write {path}")
    dialog.close()
    print(f"wrote {path}", flush=True)


def federation_shot(app, cache_dir: Path, out: Path) -> None:
    app.federation.demo_workdir = cache_dir / "site"
    app.federation.demo_rounds = 3
    app.window.tabs.setCurrentIndex(1)
    from engine.federation.demo_site import DEMO_SELECTOR_WARMUP

    app.federation.join()
    state = app.federation_state
    # past the selector-only warm-up rounds, so the plots and the ledger show all of FedSM's models
    mid = DEMO_SELECTOR_WARMUP + 3
    _wait(lambda: (mid - 1 in state.metrics and state.round >= mid and state.batch >= 1)
          or state.status in ("finished", "failed"), 900, f"round {mid} of the demo site")
    _grab(app, out / "federation_panel.png")
    app.federation.leave()
    _wait(lambda: not app.process.running, 60, "the site process to stop")


def _grab(app, path: Path) -> None:
    from PySide6.QtWidgets import QApplication

    for _ in range(5):
        QApplication.processEvents()
    path.parent.mkdir(parents=True, exist_ok=True)
    if not app.window.grab().save(str(path)):
        raise RuntimeError(f"cannot write {path}")
    print(f"wrote {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "fedsm-screenshots")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--only", choices=("first", "demo", "volume", "federation", "help"), action="append",
                        help="write only these screenshots (repeatable)")
    args = parser.parse_args(argv)
    os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtWidgets import QApplication

    from fedsm_gui.app import FedSMApp

    qt_app = QApplication.instance() or QApplication([])
    shots = {"first": first_screen_shot, "demo": demo_shot, "volume": volume_shot, "federation": federation_shot,
             "help": help_shot}
    for name, shot in shots.items():
        if args.only and name not in args.only:
            continue
        app = FedSMApp(None, demo_workdir=args.cache_dir / "site")
        app.window.resize(1440, 900)
        app.window.show()
        qt_app.processEvents()
        try:
            shot(app, args.cache_dir, args.out)
        finally:
            app.shutdown()
            app.window.close()
            app.window.deleteLater()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
