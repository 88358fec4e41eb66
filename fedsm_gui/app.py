"""``fedsm-gui [PATH] [--demo]``: builds the state, views, runners and controllers and runs the app."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import engine.api
from fedsm_gui import __version__
from fedsm_gui.controllers.demo import DemoController
from fedsm_gui.controllers.federation import FederationController
from fedsm_gui.controllers.overlay import OverlayController
from fedsm_gui.controllers.segmentation import SegmentationController
from fedsm_gui.controllers.study import StudyController
from fedsm_gui.controllers.viewer import ViewerController
from fedsm_gui.models.federation import FederationState
from fedsm_gui.models.overlay import OverlayState
from fedsm_gui.models.recent import RecentFiles
from fedsm_gui.models.segmentation import SegmentationState
from fedsm_gui.models.viewer import ViewerState
from fedsm_gui.qt_libs import platform_problem

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fedsm/demo`` (``~/.cache/fedsm/demo``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fedsm" / "demo"


def default_config_dir() -> Path:
    """``$XDG_CONFIG_HOME/fedsm`` (``~/.config/fedsm``): the recent-files list."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "fedsm"


class FedSMApp:
    """The whole app: one instance per window.

    Parameters
    ----------
    config_dir
        Where the recent-files list is kept (``None``: not kept).
    api
        The engine facade; tests may pass a module-like fake.
    demo_workdir
        Working folder of the simulated demo site (Join without a site configuration).
    demo_rounds
        Rounds of the simulated demo site.
    demo_cache_dir
        Where Demo ▸ Retrain caches the retrained demo (``--demo`` sets it again; default
        :func:`default_cache_dir`).
    """

    def __init__(self, config_dir: Path | None = None, api: ModuleType | Any = engine.api,
                 demo_workdir: Path | None = None, demo_rounds: int = 3, demo_cache_dir: Path | None = None) -> None:
        from fedsm_gui.views.main_window import MainWindow
        from fedsm_gui.workers.process import QtProcessRunner
        from fedsm_gui.workers.tasks import QtTaskRunner

        self.viewer_state = ViewerState()
        self.overlays = OverlayState()
        self.segmentation_state = SegmentationState()
        self.federation_state = FederationState()
        self.recent = RecentFiles(config_dir / "recent.json" if config_dir else None)
        self.window = MainWindow()
        self.tasks = QtTaskRunner()
        self.process = QtProcessRunner(self.window)
        w = self.window
        self.viewer = ViewerController(self.viewer_state, self.overlays, w.viewer)
        self.overlay = OverlayController(self.overlays, w.overlay_panel)
        self.studies = StudyController(self.viewer_state, self.overlays, w, self.tasks, self.recent, api)
        self.segmentation = SegmentationController(self.segmentation_state, self.viewer_state, self.overlays,
                                                   w.segmentation_panel, w, self.tasks, api)
        self.federation = FederationController(self.federation_state, w.federation_panel, self.tasks, self.process,
                                               api, demo_workdir, demo_rounds)
        self.demo = DemoController(w, self.tasks, api, self.studies, self.segmentation, self.federation,
                                   demo_cache_dir or default_cache_dir())
        w.overlay_hotkey.connect(self.overlays.toggle_visible)
        w.closing.connect(self.shutdown)

    def shutdown(self, timeout_ms: int = 10000) -> None:
        """Leave the federation and stop every worker (window closing)."""
        if self.process.running:
            self.process.stop(timeout_ms=3000)
            self.process.wait(timeout_ms)
        self.demo.cancel()
        self.segmentation.cancel()
        self.tasks.shutdown(timeout_ms)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedsm-gui", description="FedSM desktop app: study viewer with "
                                     "super-model segmentation, and a site's federation panel.")
    parser.add_argument("--version", action="version", version=f"fedsm-gui {__version__}")
    parser.add_argument("path", nargs="?", help="a fundus photo, a NIfTI/MHA/NRRD volume or a DICOM folder to open")
    parser.add_argument("--demo", action="store_true", help="open the embedded demo: a demo photo segmented by the "
                        "shipped demo super model (Demo ▸ Retrain trains it again and caches it; docs/gui.md#demo)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where a retrained demo is cached (default {default_cache_dir()})")
    parser.add_argument("--model", type=Path, default=None, help="super-model bundle (.safetensors) to load")
    parser.add_argument("--quit-when-ready", action="store_true", help="for scripted checks: exit with status 0 "
                        "once the demo (or PATH) is shown, 1 at the first error message")
    return parser.parse_args(argv)


#: Overrides of :class:`engine.demo.DemoSettings` for ``--demo`` (tests use tiny ones).
DEMO_SETTINGS: dict[str, Any] = {}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fedsm-gui``."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = platform_problem()
    if problem is not None:  # Qt would abort with a message that does not name the packages
        print(problem, file=sys.stderr, flush=True)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    qt_app = QApplication.instance() or QApplication([sys.argv[0]])
    qt_app.setApplicationName("FedSM")
    cache_dir = (args.cache_dir or default_cache_dir()).expanduser()
    app = FedSMApp(default_config_dir(), demo_workdir=cache_dir / "site", demo_cache_dir=cache_dir)
    app.window.show()
    on_ready = None
    if args.quit_when_ready:
        def finish(code: int, message: str) -> None:
            print(message, flush=True)
            qt_app.exit(code)

        shown_error = app.window.show_error

        def error_then_quit(title: str, message: str) -> None:
            shown_error(title, message)
            finish(1, f"error: {title}: {message}")

        app.window.show_error = error_then_quit  # type: ignore[method-assign]
        on_ready = finish

    def begin() -> None:
        if args.model is not None:
            app.segmentation.load_bundle(args.model)
        if args.demo:
            app.demo.start(cache_dir, on_ready=on_ready and (lambda: on_ready(0, "demo ready")), **DEMO_SETTINGS)
        elif args.path:
            app.studies.open_path(args.path, then=on_ready and (lambda study: on_ready(0, f"opened {args.path}")))

    # Started from inside the event loop, so that an exit requested by ``--quit-when-ready`` (even
    # for an error found at once) ends this loop rather than being lost before it starts.
    QTimer.singleShot(0, begin)
    try:
        return int(qt_app.exec())
    finally:
        app.window.close()  # emits ``closing``: leaves the federation and stops the workers
        app.window.deleteLater()
