"""MONAI-style datalists: which images and labels make up a site's training, validation and test sets.

A datalist is a JSON object::

    {
      "name": "site1",                       # optional scalar keys ("name", "task", ...)
      "task": "fundus",
      "training":   [{"image": "images/case000.png", "label": "labels/case000.png"}, ...],
      "validation": [...],                   # optional
      "testing":    [...]                    # optional
    }

Paths are stored relative to the folder that holds the JSON file, with ``/`` separators, so a site
folder can be moved or copied to another machine (or operating system) as a whole. MONAI's
``load_decathlon_datalist`` reads the same files.

Only the three sections named in :data:`SECTIONS` are read; other top-level lists and objects
(e.g. a Decathlon ``"labels"`` table) are ignored, and top-level scalars are available through
:func:`read_datalist_info`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from engine.data.datalist_schema import check_datalist_document
from engine.errors import DataError
from engine.io.atomic import write_text_atomic
from engine.io.guard import MAX_JSON_DEPTH, json_depth

#: The sections a datalist may hold, in the order they are written.
SECTIONS: tuple[str, ...] = ("training", "validation", "testing")
#: Keys every entry must have; their values are file paths.
PATH_KEYS: tuple[str, ...] = ("image", "label")

Scalar = str | int | float | bool | None
_SCALARS = (str, int, float, bool, type(None))

#: Whether datalists read in this context may name files outside their own folder (``--allow-outside``).
_ALLOW_OUTSIDE: ContextVar[bool] = ContextVar("fedsm_datalist_allow_outside", default=False)


@contextmanager
def outside_paths_allowed(allow: bool = True) -> Iterator[None]:
    """Within the block, datalists may name files outside their folder (the CLI's ``--allow-outside``).

    By default every path of a datalist must lie inside the datalist's own folder (after ``..``
    and symbolic links are resolved), so a datalist handed over with a site folder cannot make a
    site read, or train on, files elsewhere on the machine.
    """
    token = _ALLOW_OUTSIDE.set(bool(allow))
    try:
        yield
    finally:
        _ALLOW_OUTSIDE.reset(token)


def _check_inside(p: Path, where: str, text: str, resolved: Path, base: Path) -> None:
    """Refuse a path that leaves the datalist's folder, unless outside paths are allowed."""
    if _ALLOW_OUTSIDE.get():
        return
    how = None
    if Path(text).is_absolute() or PureWindowsPath(text).is_absolute():
        how = "is an absolute path"
    else:
        base = Path(os.path.normpath(base))
        real_base = Path(os.path.realpath(base))
        if os.path.commonpath([str(resolved), str(base)]) != str(base):
            how = "leaves the datalist's folder with '..'"
        elif os.path.commonpath([os.path.realpath(resolved), str(real_base)]) != str(real_base):
            how = "leads outside the datalist's folder through a symbolic link"
    if how:
        raise DataError(f"{p}: {where} {text!r} {how}; a datalist names files inside its own folder "
                        f"({base}). Move the datalist up to a folder that holds the data, or pass "
                        "--allow-outside if files outside it are intended")


def _to_relative(value: str | os.PathLike[str], base: Path) -> str:
    """A path as stored in the file: relative to ``base`` when absolute, always ``/``-separated."""
    p = Path(value)
    if p.is_absolute():
        try:
            p = Path(os.path.relpath(p, base))
        except ValueError:
            # Different drive on Windows: no relative path exists, keep it absolute.
            pass
    # as_posix() on the native path, plus a Windows-style re-read, so "a\\b" written on Windows
    # and "a/b" written on POSIX end up identical in the file.
    text = p.as_posix()
    if "\\" in text and not p.is_absolute():
        text = PureWindowsPath(text).as_posix()
    return text


def _resolve(text: str, base: Path) -> Path:
    """A stored path made absolute against ``base`` (the datalist's folder), ``..`` folded."""
    p = Path(PurePosixPath(text)) if "\\" not in text else Path(PureWindowsPath(text))
    if not p.is_absolute():
        p = base / p
    return Path(os.path.normpath(p))


def write_datalist(path: str | os.PathLike[str], sections: Mapping[str, Any],
                   info: Mapping[str, Scalar] | None = None) -> None:
    """Write a datalist JSON atomically, with paths relative to its folder.

    Parameters
    ----------
    path
        Where to write the JSON file; its folder is created when missing.
    sections
        ``{"training": [{"image": ..., "label": ...}, ...], "validation": [...], ...}``. Values of
        ``"image"``/``"label"`` and any ``Path`` value are treated as paths: absolute ones are
        made relative to the JSON's folder, relative ones are taken as already relative to it.
        Other values are written as given. Scalar values in ``sections`` (e.g. ``"name"``) are
        written as top-level keys, like those in ``info``.
    info
        Optional top-level scalar keys such as ``{"name": "site1", "task": "fundus"}``.

    Raises
    ------
    DataError
        When an entry is not an object, lacks ``"image"`` or ``"label"``, or a section is not a list.
    """
    target = Path(path)
    base = target.absolute().parent
    doc: dict[str, Any] = {}
    for key, value in (info or {}).items():
        _check_scalar(target, key, value)
        doc[key] = value
    # Known sections first, in a fixed order, so equal datalists are byte-identical files.
    ordered = [k for k in SECTIONS if k in sections] + [k for k in sections if k not in SECTIONS]
    for key in ordered:
        value = sections[key]
        if isinstance(value, _SCALARS):
            doc[key] = value
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise DataError(f"{target}: section {key!r} must be a list of entries, "
                            f"got {type(value).__name__}")
        entries = []
        for i, entry in enumerate(value):
            if not isinstance(entry, Mapping):
                raise DataError(f"{target}: {key}[{i}] must be a mapping with 'image' and 'label', "
                                f"got {type(entry).__name__}")
            missing = [k for k in PATH_KEYS if k not in entry]
            if missing:
                raise DataError(f"{target}: {key}[{i}] has no {' or '.join(map(repr, missing))}; every entry "
                                "needs an 'image' and a 'label' path")
            out: dict[str, Any] = {}
            for k, v in entry.items():
                if k in PATH_KEYS or isinstance(v, os.PathLike):
                    out[str(k)] = _to_relative(v, base)
                else:
                    out[str(k)] = v if isinstance(v, _SCALARS) else str(v)
            entries.append(out)
        doc[key] = entries
    write_text_atomic(target, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")


def _check_scalar(path: Path, key: str, value: Any) -> None:
    if key in SECTIONS:
        raise DataError(f"{path}: {key!r} is a section name and cannot be an info key")
    if not isinstance(value, _SCALARS):
        raise DataError(f"{path}: info key {key!r} must be a string, number or boolean, "
                        f"got {type(value).__name__}")


def _depth_checked(path: Path, text: str) -> str:
    """``text`` when its JSON nesting is within :data:`engine.io.guard.MAX_JSON_DEPTH` (no RecursionError)."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise DataError(f"{path}: JSON nested {depth} levels deep, more than the {MAX_JSON_DEPTH} a datalist may "
                        "have; the file is damaged or not a datalist")
    return text


def _read_json(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: datalist not found; check the path, or write one with the site's "
                        "images and labels (see engine.data.datalist)")
    try:
        doc = json.loads(_depth_checked(p, p.read_text(encoding="utf-8")))
    except UnicodeDecodeError as exc:
        raise DataError(f"{p}: not a UTF-8 text file ({exc}); a datalist is a JSON file") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{p}: invalid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}); "
                        "fix the file or write it again") from exc
    except OSError as exc:
        raise DataError(f"{p}: cannot read the datalist ({exc})") from exc
    if not isinstance(doc, dict):
        raise DataError(f"{p}: a datalist must be a JSON object with a 'training' list, "
                        f"got a JSON {type(doc).__name__}")

    check_datalist_document(p, doc)
    return p, doc


def _parse_sections(p: Path, doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    if "training" not in doc:
        present = ", ".join(map(repr, doc)) or "none"
        raise DataError(f"{p}: no 'training' section (top-level keys: {present}); a datalist needs "
                        "'training': [{\"image\": ..., \"label\": ...}, ...]")
    base = p.absolute().parent
    out: dict[str, list[dict[str, Any]]] = {}
    for key in SECTIONS:
        if key not in doc:
            continue
        section = doc[key]
        if not isinstance(section, list):
            raise DataError(f"{p}: {key!r} must be a list of entries, got a JSON {type(section).__name__}")
        entries = []
        for i, entry in enumerate(section):
            if not isinstance(entry, dict):
                raise DataError(f"{p}: {key}[{i}] must be an object like {{\"image\": ..., \"label\": ...}}, "
                                f"got {json.dumps(entry)[:60]}")
            missing = [k for k in PATH_KEYS if k not in entry]
            if missing:
                raise DataError(f"{p}: {key}[{i}] has no {' or '.join(map(repr, missing))}; every entry "
                                "needs an 'image' and a 'label' path")
            parsed: dict[str, Any] = {}
            for k, v in entry.items():
                if k in PATH_KEYS:
                    if not isinstance(v, str) or not v.strip():
                        raise DataError(f"{p}: {key}[{i}].{k} must be a non-empty path string, "
                                        f"got {json.dumps(v)[:60]}")
                    parsed[k] = _resolve(v, base)
                    _check_inside(p, f"{key}[{i}].{k}", v, parsed[k], base)
                else:
                    parsed[k] = v if isinstance(v, str) else json.dumps(v)
            entries.append(parsed)
        out[key] = entries
    return out


def load_datalist(path: str | os.PathLike[str]) -> dict[str, list[dict[str, Any]]]:
    """Read a datalist; return its sections with ``"image"``/``"label"`` as absolute paths.

    Parameters
    ----------
    path
        The datalist JSON file.

    Returns
    -------
    dict
        ``{"training": [{"image": Path, "label": Path, ...}], ...}`` with only the sections the
        file has (``"validation"``/``"testing"`` may be absent). Relative paths are resolved
        against the JSON's folder (absolute ones are kept). Other keys of an entry are kept:
        strings as they are, other JSON values as their JSON text. Whether the files exist is
        not checked here; the readers say which one is missing.

    Raises
    ------
    DataError
        When the file is missing, is not valid JSON, has no ``"training"`` section, or an entry
        has no ``"image"`` or ``"label"``.
    """
    p, doc = _read_json(path)
    return _parse_sections(p, doc)


def read_datalist_info(path: str | os.PathLike[str]) -> dict[str, Scalar]:
    """The datalist's top-level scalar keys, e.g. ``{"name": "site1", "task": "fundus"}``.

    Lists and objects at the top level (the sections, a Decathlon ``"labels"`` table) are left out.
    The file must be a valid datalist (see :func:`load_datalist`).
    """
    p, doc = _read_json(path)
    _parse_sections(p, doc)
    return {k: v for k, v in doc.items() if isinstance(v, _SCALARS)}


def load_datalist_with_info(path: str | os.PathLike[str]) -> tuple[dict[str, list[dict[str, Any]]],
                                                                   dict[str, Scalar]]:
    """:func:`load_datalist` and :func:`read_datalist_info` with a single read of the file."""
    p, doc = _read_json(path)
    return _parse_sections(p, doc), {k: v for k, v in doc.items() if isinstance(v, _SCALARS)}
