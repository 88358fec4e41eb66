"""The public surface of ``engine.io``: what ``__all__`` names exists, and importing it stays cheap."""

from __future__ import annotations

import inspect
import subprocess
import sys

import engine.io


def test_all_names_what_the_package_exports() -> None:
    for name in engine.io.__all__:
        obj = getattr(engine.io, name)
        assert obj.__module__.startswith("engine.io."), name
        assert name in engine.io.__doc__, f"{name} is exported but the package docstring does not mention it"
    public = {name for name, obj in vars(engine.io).items()
              if not name.startswith("_") and not inspect.ismodule(obj)}
    assert public == set(engine.io.__all__)
    assert engine.io.__all__ == sorted(engine.io.__all__)


def test_importing_the_package_loads_no_image_library() -> None:
    heavy = ("pydicom", "highdicom", "nibabel", "SimpleITK", "PIL", "torch")
    code = f"import sys, engine.io; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
