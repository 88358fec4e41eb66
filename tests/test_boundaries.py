"""Architecture rules that keep the engine easy to change."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_api_does_not_import_torch():
    code = "import sys, engine.api; print('torch' in sys.modules, 'monai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_engine_never_imports_qt():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "engine").rglob("*.py")
        if any(word in p.read_text(encoding="utf-8") for word in ("PySide6", "PyQt", "fedsm_gui"))
    ]
    assert offenders == []
