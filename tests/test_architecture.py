"""The architecture's import rules, checked by import-linter (the contracts live in pyproject.toml).

- The engine never imports the desktop app or Qt (it runs headless on a coordinator without a display).
- The app reaches the engine only through ``engine.api``, plus the study types and errors it displays.
- The engine's packages form layers: a lower one never imports a higher one.
- No import cycle between the modules of any package, counting imports inside functions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(cwd: Path, config: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(lint), str(config), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_the_project_keeps_its_import_contracts():
    done = _lint_imports(ROOT, ROOT / "pyproject.toml", ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_contracts_catch_qt_in_the_engine_a_wrong_way_import_a_layer_upside_down_and_a_cycle(tmp_path):
    # the project's own contracts, run over a small tree that breaks each of them
    (tmp_path / "engine" / "io").mkdir(parents=True)
    (tmp_path / "fedsm_gui").mkdir()
    for package in ("engine", "engine/io", "fedsm_gui"):
        (tmp_path / package / "__init__.py").write_text("")
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named = {m for c in settings["contracts"] for m in c.get("forbidden_modules", []) if m.startswith("engine.")}
    layers = {f"engine.{name.strip()}" for c in settings["contracts"] for layer in c.get("layers", [])
              for name in layer.split("|")}
    assert "engine.fl" in layers and "engine.tasks" in layers
    for module in named | layers | {"engine.api", "engine.io.study"}:  # every module a contract names must exist
        path = tmp_path / (module.replace(".", "/") + ".py")
        if not path.with_suffix("").is_dir():
            path.write_text("")
    (tmp_path / "engine" / "viewer.py").write_text("def show():\n    from PySide6 import QtWidgets\n"
                                                   "    import fedsm_gui\n")
    (tmp_path / "fedsm_gui" / "panel.py").write_text("from engine import api\nfrom engine.io import study\n"
                                                     "import engine.fl\n")
    (tmp_path / "engine" / "tasks.py").write_text("def method():\n    import engine.fl\n")  # a layer upside down
    (tmp_path / "engine" / "io" / "masks.py").write_text("from engine.io import photos\n")
    (tmp_path / "engine" / "io" / "photos.py").write_text("def read():\n    from engine.io import masks\n")  # a cycle
    config = tmp_path / "pyproject.toml"  # the project's own file: lint-imports reads its [tool.importlinter]
    shutil.copyfile(ROOT / "pyproject.toml", config)
    done = _lint_imports(tmp_path, config, tmp_path)
    assert done.returncode == 1, done.stdout
    assert "4 broken" in done.stdout, done.stdout
    assert "engine.viewer -> PySide6" in done.stdout and "engine.viewer -> fedsm_gui" in done.stdout
    assert "fedsm_gui.panel -> engine.fl" in done.stdout
    assert "engine.tasks -> engine.fl" in done.stdout
    assert "No cycles are allowed in engine.io" in done.stdout
    assert "engine.io.study" not in done.stdout.split("Broken contracts")[-1]  # the study types are allowed
