"""Paths as reports and exports may show them: relative, or a file name, never absolute.

Folder names often name patients (``/data/Doe_John/MR/...``), sites or users, so nothing FedSM
writes for others to read (``routing.json``, ``report.json``) holds an absolute path:

- :func:`public_path`: a path relative to the folder the user named (the input folder of
  ``fedsm infer``), ``"."`` for that folder itself, and for a single file only its file name;
- :func:`scrub_absolute_paths`: every absolute path string inside a JSON-able document made
  relative to a base folder (the report's own folder) when it lies inside it, else reduced to its
  last component.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any

PathLike = str | os.PathLike[str]


def public_path(path: PathLike, root: PathLike) -> str:
    """``path`` as a report may show it: relative to ``root``; a file given as ``root`` is its name.

    Parameters
    ----------
    path
        A file or folder found at or under ``root``.
    root
        What the user named: a folder (paths are shown relative to it, the folder itself as
        ``"."``, never with its own name) or a file (shown as its file name).
    """
    p, r = Path(path), Path(root)
    if p == r:
        return "." if r.is_dir() else r.name
    try:
        return p.resolve().relative_to(r.resolve()).as_posix()
    except ValueError:
        return p.name


def _is_absolute(text: str) -> bool:
    return text.startswith(("/", "\\\\")) or (len(text) > 2 and text[1] == ":" and text[2] in "/\\")


def scrub_absolute_paths(doc: Any, base: PathLike | None = None) -> Any:
    """A copy of ``doc`` (dicts, lists, strings, numbers) with absolute path strings made public.

    An absolute path inside ``base`` becomes relative to it; any other keeps only its last
    component. Other values are returned unchanged.
    """
    if isinstance(doc, dict):
        return {key: scrub_absolute_paths(value, base) for key, value in doc.items()}
    if isinstance(doc, list | tuple):
        return [scrub_absolute_paths(value, base) for value in doc]
    if isinstance(doc, str) and _is_absolute(doc) and "\n" not in doc:
        if base is not None:
            try:
                return Path(doc).resolve().relative_to(Path(base).resolve()).as_posix() or "."
            except (ValueError, OSError):
                pass
        return PurePath(doc).name
    return doc
