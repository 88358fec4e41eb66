"""GUI test fixtures: offscreen Qt, a leak check for top-level widgets, the app, a tiny demo."""

from __future__ import annotations

import os

os.environ["QT_QPA_PLATFORM"] = "offscreen"  # before anything imports Qt

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gui_helpers import TINY_DEMO

from engine.io.study import LabelMap, Study


@pytest.fixture(autouse=True)
def no_leaked_widgets(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a Qt test that leaves top-level widgets behind (closed and deleted by its end).

    Only tests that use Qt (the ``qapp`` or ``qtbot`` fixtures) are checked. This fixture does
    not depend on ``qtbot``, so it is torn down after qtbot has closed the widgets it owns.
    """
    if not ({"qapp", "qtbot"} & set(request.fixturenames)):
        yield
        return
    from PySide6.QtCore import QCoreApplication, QEvent
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])
    before = {id(w) for w in app.topLevelWidgets()}
    yield
    for _ in range(3):
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
        app.processEvents()
    leaked = [w for w in app.topLevelWidgets() if id(w) not in before and w.isVisible()]
    leaked += [w for w in app.topLevelWidgets() if id(w) not in before and not w.parent()
               and type(w).__module__.startswith("fedsm_gui")]
    if leaked:
        names = sorted({f"{type(w).__name__}({w.objectName()!r})" for w in leaked})
        for widget in leaked:
            widget.close()
            widget.deleteLater()
        pytest.fail(f"test leaked top-level widgets: {names}")


@pytest.fixture
def volume_study() -> Study:
    """A 40 x 30 x 12 MR volume with a bright block toward the patient's right, anterior, superior."""
    rng = np.random.default_rng(0)
    array = (rng.random((40, 30, 12)) * 50).astype(np.float32)
    array[30:, 20:, 8:] += 500.0
    return Study(array, "volume", np.diag([1.0, 1.0, 3.0, 1.0]), (1.0, 1.0, 3.0), modality="MR",
                 window=(250.0, 500.0), source=Path("volume.nii.gz"), source_format="nifti")


@pytest.fixture
def volume_labels(volume_study: Study) -> LabelMap:
    labels = np.zeros(volume_study.shape, dtype=np.uint8)
    labels[10:20, 10:20, 4:8] = 1
    return LabelMap(labels, {1: "prostate"})


@pytest.fixture
def photo_study() -> Study:
    rng = np.random.default_rng(1)
    array = (rng.random((48, 64, 3)) * 255).astype(np.uint8)
    return Study(array, "photo", np.eye(4), (1.0, 1.0), modality="OP", source=Path("photo.png"),
                 source_format="png")


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo prepared once per session with tiny settings (real training, a few seconds)."""
    import engine.api

    return engine.api.prepare_demo(tmp_path_factory.mktemp("demo"), **TINY_DEMO)


@pytest.fixture
def fedsm_app(qtbot, tmp_path: Path):
    """The whole app (window not shown), with a private config dir and demo-site workdir."""
    from fedsm_gui.app import FedSMApp

    app = FedSMApp(config_dir=tmp_path / "config", demo_workdir=tmp_path / "site", demo_rounds=1)
    qtbot.addWidget(app.window)
    app.window.resize(1200, 800)
    yield app
    app.shutdown(timeout_ms=20000)

