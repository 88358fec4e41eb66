"""The start-up check of the system libraries Qt's xcb plugin needs (no Qt involved)."""

from __future__ import annotations

import sys

import pytest

from fedsm_gui import app as gui_app
from fedsm_gui.qt_libs import XCB_LIBRARIES, missing_xcb_packages, platform_problem, uses_xcb

MISSING = {"libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1"}


def _loads(soname: str) -> bool:
    return soname not in MISSING


def test_missing_libraries_are_named_with_their_debian_packages():
    assert missing_xcb_packages(_loads) == [("libxcb-cursor.so.0", "libxcb-cursor0"),
                                            ("libxcb-icccm.so.4", "libxcb-icccm4"),
                                            ("libxcb-keysyms.so.1", "libxcb-keysyms1")]
    line = platform_problem({"DISPLAY": ":0"}, "linux", _loads)
    assert line is not None and "\n" not in line
    assert line.endswith("sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1")
    assert platform_problem({"DISPLAY": ":0"}, "linux", lambda s: True) is None
    assert len(set(XCB_LIBRARIES.values())) == len(XCB_LIBRARIES)


def test_check_applies_only_where_qt_would_use_xcb():
    assert uses_xcb({}, "linux") and uses_xcb({"QT_QPA_PLATFORM": "xcb"}, "linux")
    assert not uses_xcb({"QT_QPA_PLATFORM": "offscreen"}, "linux")
    assert not uses_xcb({"WAYLAND_DISPLAY": "wayland-0"}, "linux")
    assert not uses_xcb({}, "darwin")
    assert platform_problem({"QT_QPA_PLATFORM": "offscreen"}, "linux", lambda s: False) is None
    no_display = platform_problem({}, "linux", lambda s: True)
    assert no_display is not None and "DISPLAY" in no_display and "QT_QPA_PLATFORM=offscreen" in no_display


def _app_must_not_start(*args, **kwargs):
    raise AssertionError("fedsm-gui built its window although the platform check should have stopped it")


def test_fedsm_gui_stops_with_the_line_before_qt_starts(monkeypatch, capsys):
    """Passes the same whether or not this machine has the X11 libraries: the check's defaults are
    resolved at call time, so the fake loader is the one used; and should the check ever let the
    app through, building the window fails at once instead of starting an event loop that never ends."""
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("fedsm_gui.qt_libs._loads", _loads)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr(gui_app, "FedSMApp", _app_must_not_start)
    assert gui_app.main(["--demo"]) == 1
    err = capsys.readouterr().err
    assert "libxcb-icccm4" in err and "Traceback" not in err


def test_defaults_are_read_when_the_check_runs(monkeypatch):
    """Replacing the loader or the platform after import changes what the check reports."""
    monkeypatch.setattr("fedsm_gui.qt_libs._loads", lambda soname: False)
    monkeypatch.setattr("sys.platform", "linux")
    assert len(missing_xcb_packages()) == len(XCB_LIBRARIES)
    assert "libxcb1" in (platform_problem({"DISPLAY": ":0"}) or "")
    monkeypatch.setattr("sys.platform", "darwin")
    assert platform_problem({"DISPLAY": ":0"}) is None


def test_fedsm_gui_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gui_app.parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedsm-gui {gui_app.__version__}"


def _xcb_plugin_not_found() -> set[str]:
    """Sonames the dynamic loader cannot resolve for PySide6's xcb plugin, as ``ldd`` reports them."""
    import shutil
    import subprocess
    from pathlib import Path

    import PySide6

    plugin = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    ldd = shutil.which("ldd")
    if not sys.platform.startswith("linux") or ldd is None or not plugin.is_file():
        pytest.skip("needs Linux, ldd and PySide6's xcb plugin")
    out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=30, check=True).stdout
    return {line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line}


def test_check_names_every_library_the_loader_cannot_find_for_the_real_plugin():
    """On this machine, against the real loader: whatever ``ldd`` cannot resolve for ``libqxcb.so``
    (on a stock Debian 12: libxcb-icccm.so.4, libxcb-keysyms.so.1) the check reports missing too."""
    not_found = _xcb_plugin_not_found()
    missing = {soname for soname, _ in missing_xcb_packages()}
    assert not_found <= set(XCB_LIBRARIES), f"the check does not know {not_found - set(XCB_LIBRARIES)}"
    assert not_found <= missing
