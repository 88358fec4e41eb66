"""FedSM desktop app: study viewer, super-model segmentation panel and a site's federation panel.

Layers (see ``docs/gui.md``):

- :mod:`fedsm_gui.models`: Qt-free state (study view, overlays, segmentation, federation) and
  the pure numpy rendering of slices and overlays;
- :mod:`fedsm_gui.controllers`: the only glue between state, views and :mod:`engine.api`;
  Qt-free, tested with mock views;
- :mod:`fedsm_gui.views`: PySide6 widgets that emit intent signals and expose ``set_*`` methods;
- :mod:`fedsm_gui.workers`: Qt thread-pool and QProcess runners, so no engine call ever runs
  on the event loop's thread.

The app talks to the engine only through :mod:`engine.api`, :mod:`engine.io.study` and
:mod:`engine.errors` (checked by ``tests/test_boundaries_gui.py``).
"""

__version__ = "0.1.0"
