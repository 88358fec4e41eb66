"""Architecture rules between the engine and the desktop app, checked on the import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The only engine modules the app may import.
GUI_MAY_IMPORT = {"engine.api", "engine.io.study", "engine.errors"}
QT_PACKAGES = ("PySide6", "PyQt5", "PyQt6", "shiboken6", "pytestqt")
HEAVY = ("torch", "monai", "flwr", "safetensors", "nibabel", "pydicom", "SimpleITK", "highdicom", "matplotlib")


def _imports(path: Path) -> list[str]:
    """Absolute module names imported by one file (``from engine import api`` -> ``engine.api``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "engine":
            names += [f"engine.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


def test_engine_never_imports_qt_or_the_app():
    offenders = [f"{p.relative_to(ROOT)}: {name}" for p in sorted((ROOT / "engine").rglob("*.py"))
                 for name in _imports(p) if _top(name) in (*QT_PACKAGES, "fedsm_gui")]
    assert offenders == []


def test_app_reaches_the_engine_only_through_its_facade():
    offenders = []
    for path in sorted((ROOT / "fedsm_gui").rglob("*.py")):
        for name in _imports(path):
            if _top(name) == "engine" and name != "engine" and name not in GUI_MAY_IMPORT:
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
            if name == "engine":
                offenders.append(f"{path.relative_to(ROOT)}: bare 'import engine'")
            if _top(name) in HEAVY:
                offenders.append(f"{path.relative_to(ROOT)}: {name} (use engine.api)")
    assert offenders == []


def test_models_and_controllers_are_qt_free():
    offenders = [f"{p.relative_to(ROOT)}: {name}" for sub in ("models", "controllers")
                 for p in sorted((ROOT / "fedsm_gui" / sub).rglob("*.py"))
                 for name in _imports(p) if _top(name) in QT_PACKAGES]
    offenders += [f"fedsm_gui/views/bases.py: {name}" for name in _imports(ROOT / "fedsm_gui/views/bases.py")
                  if _top(name) in QT_PACKAGES]
    assert offenders == []


def test_starting_the_app_module_is_cheap():
    code = ("import sys, fedsm_gui.app, fedsm_gui.controllers.demo; "
            "print(sorted(m for m in ('torch', 'monai', 'flwr', 'PySide6.QtWidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    # Qt widgets are imported when the window is built, the engine's heavy parts when first used
    assert out.stdout.split() == ["[]"]


def test_the_checker_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from engine.fl.methods import FedSM\nimport torch\nfrom engine import api, errors\n")
    assert _imports(bad) == ["engine.fl.methods", "torch", "engine.api", "engine.errors"]
