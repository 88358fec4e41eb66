"""Before Qt starts: are the system libraries its X11 (xcb) platform plugin loads present?

PySide6's wheels bundle Qt itself but not the X11 client libraries; on a stock Debian or Ubuntu
machine some are missing (``libxcb-cursor0``, ``libxcb-icccm4``, ``libxcb-keysyms1`` …), and Qt
then aborts with a long message that does not name the packages. :func:`missing_xcb_packages`
tries to load each library the xcb plugin links against (the list ``ldd libqxcb.so`` gives for
PySide6 6.x) and :func:`platform_problem` turns what is missing into one line naming the Debian
packages to install. Nothing here imports Qt.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

#: Shared library (soname) the xcb platform plugin needs -> the Debian/Ubuntu package holding it.
XCB_LIBRARIES: dict[str, str] = {
    "libxcb.so.1": "libxcb1",
    "libX11.so.6": "libx11-6",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
}


def _loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def missing_xcb_packages(loads: Callable[[str], bool] | None = None) -> list[tuple[str, str]]:
    """``(soname, package)`` of every library of :data:`XCB_LIBRARIES` that cannot be loaded.

    ``loads`` defaults to :func:`_loads`, looked up at call time (so a test can replace it).
    """
    loads = _loads if loads is None else loads
    return [(soname, package) for soname, package in XCB_LIBRARIES.items() if not loads(soname)]


def uses_xcb(environ: Mapping[str, str], platform: str | None = None) -> bool:
    """Whether Qt will pick its xcb platform plugin (Linux, no other platform asked for).

    ``platform`` defaults to ``sys.platform`` read at call time.
    """
    platform = sys.platform if platform is None else platform
    if not platform.startswith("linux"):
        return False
    wanted = environ.get("QT_QPA_PLATFORM", "").split(";")[0].split(":")[0].strip()
    if wanted:
        return wanted == "xcb"
    # Qt prefers Wayland in a Wayland session (and falls back to xcb only if that fails).
    return not environ.get("WAYLAND_DISPLAY")


def platform_problem(environ: Mapping[str, str] | None = None, platform: str | None = None,
                     loads: Callable[[str], bool] | None = None) -> str | None:
    """One line saying why Qt cannot open a window here and what to do; ``None`` when it can.

    Checks only what Qt would otherwise report obscurely: the libraries of the xcb plugin, and
    that an X display is set at all. Every default (``os.environ``, ``sys.platform``,
    :func:`_loads`) is resolved when the function runs, never when the module is imported: a
    default bound at import time cannot be replaced by a test, which then starts the real app.
    """
    env = os.environ if environ is None else environ
    if not uses_xcb(env, platform):
        return None
    missing = missing_xcb_packages(loads)
    if missing:
        packages = " ".join(package for _, package in missing)
        names = ", ".join(soname for soname, _ in missing)
        return (f"fedsm-gui: Qt's X11 platform plugin needs system libraries that are missing ({names}); "
                f"install them with:  sudo apt-get install {packages}")
    if not env.get("DISPLAY"):
        return ("fedsm-gui: no display to open a window on (DISPLAY is not set); run it in a desktop session, "
                "or set QT_QPA_PLATFORM=offscreen for scripted checks")
    return None
