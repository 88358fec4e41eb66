"""Paths as reports and exports may show them: relative, or a file name, never absolute.

Folder names often name patients (``/data/Doe_John/MR/...``), sites or users, so nothing FedSM
writes for others to read (``routing.json``, ``report.json``) holds an absolute path:

- :func:`public_path`: a path relative to the folder the user named (the input folder of
  ``fedsm infer``), ``"."`` for that folder itself, and for a single file only its file name;
- :func:`scrub_absolute_paths`: every absolute path string inside a JSON-able document made
  relative to a base folder (the report's own folder) when it lies inside it, else reduced to its
  last component;
- :func:`neutral_name`: the name outputs get by default instead of the input's file name
  (``case-`` and 10 hex digits of the SHA-256 of the input's bytes), and :func:`source_stem`, the
  input's own name, used only when the user keeps names (``fedsm infer --keep-names``, the app's
  "Name the mask after the image file").

Why a content hash: it is the same on every run and machine (outputs are reproducible, and a mask
can be matched to its image by hashing the image again), it does not change when other files are
added to a folder (numbering by input order would), and the name is not part of what is hashed, so
it cannot be recovered by trying candidate names (a hash of the *path* can: a list of patients and
birth dates is enough to test ``DOE^JOHN_1970-01-01.png`` against it).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engine.io.study import Study

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


#: Neutral output names: ``case-`` and this many hex digits of the input's SHA-256 (40 bits).
NEUTRAL_PREFIX = "case-"
NEUTRAL_DIGITS = 10
_HASH_CHUNK = 1 << 20
#: Suffixes dropped from a file name to give its stem (longest first where one ends another).
_STEM_SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".nhdr", ".png", ".jpg", ".jpeg", ".tif", ".tiff",
                  ".bmp", ".dcm", ".dicom", ".ima")


def content_name(files: Iterable[PathLike]) -> str:
    """``case-`` + the first :data:`NEUTRAL_DIGITS` hex digits of the SHA-256 of the files' bytes, in order.

    Each file's length is hashed before its bytes, so two lists of files never hash alike by
    moving bytes from one file to the next.
    """
    digest = hashlib.sha256()
    for path in files:
        with Path(path).open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            digest.update(fh.tell().to_bytes(8, "little"))
            fh.seek(0)
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
    return NEUTRAL_PREFIX + digest.hexdigest()[:NEUTRAL_DIGITS]


def study_files(study: Study) -> list[Path]:
    """The files a study was read from: a DICOM series' files (in slice order), else its source file."""
    if study.dicom_files:
        return [Path(p) for p in study.dicom_files]
    if study.source is not None and Path(study.source).is_file():
        return [Path(study.source)]
    return []


def neutral_name(study: Study) -> str:
    """The name outputs made from ``study`` get by default: :func:`content_name` of its files.

    A study made in memory (no files) is named after its pixels' bytes instead.
    """
    files = study_files(study)
    if files:
        return content_name(files)

    digest = hashlib.sha256(np.ascontiguousarray(study.array).tobytes())
    return NEUTRAL_PREFIX + digest.hexdigest()[:NEUTRAL_DIGITS]


def source_stem(path: PathLike) -> str:
    """A file's name without its image suffix (``case7.nii.gz`` -> ``case7``); a folder's name as it is."""
    name = Path(path).name
    for suffix in _STEM_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def mask_stem(study: Study, keep_names: bool = False) -> str:
    """Stem of the mask file made from ``study``: :func:`neutral_name`, or with ``keep_names`` the source's own."""
    if not keep_names:
        return neutral_name(study)
    if study.source is None:
        return "study"
    return source_stem(study.source)
