"""The shipped demo (``resources/fedsm_demo``): a normal super-model bundle for the default demo
settings, found from the source tree, an editable install and a built wheel; the order in which
``prepare_demo`` picks a demo."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.demo import (
    MANIFEST,
    SHIPPED_BUNDLE,
    SHIPPED_PACKAGE,
    DemoSettings,
    prepare_demo,
    shipped_demo,
    shipped_demo_dir,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "resources" / SHIPPED_PACKAGE


def _manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))


def test_the_shipped_demo_is_a_small_float16_super_model_of_the_default_settings():
    import torch

    from engine.bundle import file_sha256, load_bundle

    folder = shipped_demo_dir()
    assert folder is not None
    manifest = _manifest(folder)
    assert manifest["settings"] == asdict(DemoSettings())  # rebuild it when the defaults change
    bundle = folder / manifest["files"]["bundle"]
    assert bundle.stat().st_size == manifest["bundle_bytes"] < 40_000_000
    assert file_sha256(bundle) == manifest["bundle_sha256"]
    loaded = load_bundle(bundle)  # safetensors, no pickle
    assert (loaded.metadata.method, loaded.metadata.site_names) == ("fedsm", ["site1", "site2", "site3"])
    floats = [t.dtype for part in (loaded.global_weights, loaded.selector_weights, *loaded.personal_weights.values())
              for t in part.values() if t.is_floating_point()]
    assert set(floats) == {torch.float16}
    assert loaded.metadata.extra["demo"]["weights"] == "float16"
    assert manifest["meets_target"], manifest["validation_dice_worst_site"]


def test_the_shipped_demo_is_trained_as_the_product_trains_by_default():
    """The first super model a user sees is FedSM as ``fedsm simulate`` trains it unless told otherwise."""
    from engine.bundle import read_metadata
    from engine.simulate import SimulationConfig

    defaults = SimulationConfig()
    assert (DemoSettings().personalization, DemoSettings().selector_width) == \
        (defaults.personalization, defaults.selector_width)
    folder = shipped_demo_dir()
    meta = read_metadata(folder / _manifest(folder)["files"]["bundle"])
    assert (meta.personalization, meta.selector_width) == (defaults.personalization, defaults.selector_width)


def test_the_shipped_demo_photo_goes_to_its_own_sites_model():
    """Measured when the photo was chosen, and again now with the shipped file (the app's path)."""
    from engine.api import open_study, segment_study

    paths = prepare_demo(ROOT / "unused-cache")
    own = f"site{DemoSettings().study_site}"
    assert paths["study_routing"]["model"] == own and not paths["study_routing"]["unlike_sites"]
    record = segment_study(Path(paths["bundle"]), open_study(Path(paths["study"]))).records[0]
    assert record.model == own, record.reason
    assert record.reason.startswith(f"{own}: ") and "unlike" not in record.reason


def test_prepare_demo_returns_the_shipped_demo_without_writing_anything(tmp_path):
    paths = prepare_demo(tmp_path / "cache")
    assert paths["source"] == "shipped" and paths["trained"] is False
    assert Path(paths["bundle"]).parent == shipped_demo_dir()
    assert paths["site_workdir"] == str(tmp_path / "cache" / "site") and paths["data_dir"] is None
    assert not (tmp_path / "cache").exists()


def test_a_retrained_demo_in_the_cache_comes_before_the_shipped_one(tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(shipped_demo_dir(), cache)  # the same files and manifest, as a retraining leaves them
    assert prepare_demo(cache)["source"] == "cache"
    (cache / SHIPPED_BUNDLE).write_bytes(b"damaged")  # no longer what the manifest names: not used
    paths = prepare_demo(cache)
    assert paths["source"] == "shipped" and Path(paths["bundle"]).parent == shipped_demo_dir()


def test_a_damaged_or_other_shipped_demo_is_not_used(tmp_path, monkeypatch):
    import engine.demo

    copy = tmp_path / "shipped"
    shutil.copytree(shipped_demo_dir(), copy)
    monkeypatch.setattr(engine.demo, "shipped_demo_dir", lambda: copy)
    assert shipped_demo(tmp_path)["source"] == "shipped"
    assert shipped_demo(tmp_path, DemoSettings(rounds=3)) is None  # trained with other settings
    (copy / SHIPPED_BUNDLE).write_bytes((copy / SHIPPED_BUNDLE).read_bytes()[:-1] + b"\x00")
    assert shipped_demo(tmp_path) is None


def test_the_source_tree_is_found_without_the_installed_package(monkeypatch):
    from importlib import resources

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(resources, "files", missing)
    assert shipped_demo_dir() == SOURCE


def _project_copy(tmp_path: Path) -> Path:
    """What a source distribution holds: the packages, the demo, pyproject.toml and README.md."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("engine", "fedsm_gui", "resources"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    return src


def _find_demo(site_dir: Path, cwd: Path) -> str:
    """``engine.demo.shipped_demo_dir()`` in a fresh interpreter that sees ``site_dir`` first.

    The running environment's own editable install of this checkout (an import hook) is removed
    first, so the answer comes from ``site_dir`` alone.
    """
    code = ("import site, sys\n"
            "mine = lambda f: getattr(f, '__module__', '').startswith('__editable__')\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if not mine(f)]\n"
            "for name in [m for m in sys.modules if m.startswith('__editable__')]:\n"
            "    del sys.modules[name]\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "site.addsitedir(sys.argv[1])\n"
            "import engine, engine.demo\n"
            "print(engine.__file__)\n"
            "print(engine.demo.shipped_demo_dir())\n")
    out = subprocess.run([sys.executable, "-c", code, str(site_dir)], cwd=cwd, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout


def _installed_here() -> list[tuple[str, bytes]]:
    """The running environment's installed fedsm distributions and their file records."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    return sorted((d.name, (d / "RECORD").read_bytes() if (d / "RECORD").is_file() else b"")
                  for d in purelib.glob("fedsm-*.dist-info"))


@pytest.mark.slow
def test_a_built_wheel_carries_the_shipped_demo(tmp_path):
    src = _project_copy(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("fedsm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"{SHIPPED_PACKAGE}/{name}" for name in (MANIFEST, *_manifest(SOURCE)["files"].values())}
    assert shipped <= names
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    engine_file, demo_dir = _find_demo(installed, tmp_path).split()
    assert Path(engine_file).is_relative_to(installed)
    assert Path(demo_dir) == installed / SHIPPED_PACKAGE


@pytest.mark.slow
def test_an_editable_install_finds_the_shipped_demo_in_the_checkout(tmp_path):
    src = _project_copy(tmp_path)
    prefix = tmp_path / "prefix"
    before = _installed_here()
    # --ignore-installed: without it pip would first uninstall the running environment's own fedsm
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--ignore-installed",
                    "-q", "--prefix", str(prefix), "-e", str(src)], check=True, capture_output=True, timeout=300)
    (site_dir,) = prefix.glob("lib/python*/site-packages")
    engine_file, demo_dir = _find_demo(site_dir, tmp_path).split()
    assert Path(engine_file).is_relative_to(src)
    assert _installed_here() == before  # the running environment's install is untouched
    assert Path(demo_dir) == src / "resources" / SHIPPED_PACKAGE
