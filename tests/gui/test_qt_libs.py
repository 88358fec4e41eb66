"""The start-up check of the system libraries Qt's xcb plugin needs (no Qt involved)."""

from __future__ import annotations

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


def test_fedsm_gui_stops_with_the_line_before_qt_starts(monkeypatch, capsys):
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    monkeypatch.setenv("DISPLAY", ":0")
    monkeypatch.setattr("fedsm_gui.qt_libs._loads", _loads)
    monkeypatch.setattr("sys.platform", "linux")
    assert gui_app.main(["--demo"]) == 1
    err = capsys.readouterr().err
    assert "libxcb-icccm4" in err and "Traceback" not in err


def test_fedsm_gui_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gui_app.parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedsm-gui {gui_app.__version__}"
