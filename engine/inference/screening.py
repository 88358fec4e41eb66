"""What ``fedsm infer`` should not segment, and inputs that do not look like the bundle's task.

Skipped (folder inputs; each listed in ``routing.json`` under ``"skipped"`` with its reason):

1. **masks named by a datalist**: any ``*.json`` datalist in the input folder or its parent names
   its ``label`` files (drishti: both soft maps of a case); those files are masks, not images;
2. **label maps by content**: a single-channel photo (8-bit grey or palette) holding at most
   :data:`MAX_LABEL_VALUES` distinct values, or a volume file of integer type whose name says
   ``mask``/``seg``/``label``/``gt`` and holds at most that many distinct values.

A file named explicitly (``--input mask.png``) is still segmented; the same tests then give a
warning instead.

Warnings (``routing.json``: per input ``"warnings"``; also logged) when the opened study does not
look like what the bundle was trained on:

- prostate bundles: the DICOM/NRRD modality is known and is not MR (e.g. CT);
- fundus bundles: a photo whose colour channels are (nearly) equal is grey, not a colour fundus
  photograph; a fundus photo is red-dominant, so a mean red below the mean blue is flagged too.

These are heuristics stated as such: a warning says the result may be meaningless, it does not
stop the run.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from engine.data.datalist import load_datalist_with_info, outside_paths_allowed
from engine.errors import FedSMError
from engine.io.guard import open_image
from engine.io.label_conventions import DATALIST_KEY, convention_for

log = logging.getLogger(__name__)

#: A label map has at most this many distinct values (background plus a few structures).
MAX_LABEL_VALUES = 8
_LABEL_NAME = re.compile(r"(^|[_\-.])(mask|masks|seg|segmentation|label|labels|gt|softmap)([_\-.]|$)|softmap",
                         re.IGNORECASE)


def datalist_labels(folder: Path) -> set[str]:
    """Resolved paths of the ``label`` files named by datalists in ``folder`` and its parent."""
    found: set[str] = set()
    for where in {folder, folder.parent}:
        try:
            candidates = sorted(where.glob("*.json"))
        except OSError:
            continue
        for path in candidates:
            try:
                doc = json.loads(path.read_text(encoding="utf-8"))
                if not (isinstance(doc, dict) and isinstance(doc.get("training"), list)):
                    continue
                with outside_paths_allowed():  # only reading names; nothing is opened
                    sections, info = load_datalist_with_info(path)
                convention = convention_for(None, info.get(DATALIST_KEY))
            except (OSError, ValueError, FedSMError):
                continue
            for entries in sections.values():
                for entry in entries:
                    files = [entry["label"]]
                    try:
                        files = list(convention.label_files(entry["label"]))
                    except FedSMError:
                        pass
                    found.update(os.path.realpath(f) for f in files)
    return found


def label_map_reason(path: Path, volumetric: bool) -> str | None:
    """Why ``path`` looks like a label map rather than an image, or ``None`` (reads a header and a few pixels)."""
    try:
        if not volumetric:
            return _photo_reason(path)
        return _volume_reason(path)
    except Exception as exc:  # a file that cannot be screened is read (and reported) by the readers
        log.debug("could not screen %s: %s", path, exc)
        return None


def _photo_reason(path: Path) -> str | None:
    # open_image checks the declared size (and what else a decoder would allocate) before any pixel is read.
    with open_image(path, "image") as img:
        if img.mode not in ("L", "P", "1", "I;16", "I"):
            return None
        if img.width * img.height > 64_000_000:
            return None
        values = np.unique(np.asarray(img))
    if len(values) <= MAX_LABEL_VALUES:
        shown = ", ".join(str(int(v)) for v in values[:MAX_LABEL_VALUES])
        return f"a single-channel image with only {len(values)} value(s) ({shown}): a label map, not a photo"
    return None


def _volume_reason(path: Path) -> str | None:
    if not _LABEL_NAME.search(path.name):
        return None
    name = path.name.lower()
    if not name.endswith((".nii", ".nii.gz")):
        return None
    img = nib.load(str(path))
    if not np.issubdtype(img.get_data_dtype(), np.integer):
        return None
    shape = img.shape
    middle = np.asarray(img.dataobj[..., shape[2] // 2] if len(shape) >= 3 else img.dataobj)
    values = np.unique(middle)
    if len(values) <= MAX_LABEL_VALUES:
        return f"an integer volume named like a mask with only {len(values)} value(s) in its middle slice: a label map"
    return None


def task_warnings(study: Any, task: Any, where: str | None = None) -> list[str]:
    """Ways the opened study does not look like the images the bundle's task was trained on.

    Each warning starts with ``where`` (what the caller calls the input: its case name, or its
    path when names are kept); default: the study's source.
    """
    out: list[str] = []
    where = where or str(study.source or "the input")
    if task.volumetric:
        modality = (study.modality or "").upper()
        if modality and modality != "MR":
            out.append(f"{where}: modality {modality}, but the {task.name} bundle was trained on MR; its masks are "
                       "probably meaningless")
        return out
    array = np.asarray(study.array)
    if array.ndim == 3 and array.shape[2] >= 3:
        step = max(1, int(np.sqrt(array.shape[0] * array.shape[1] / 250_000)))
        sample = array[::step, ::step, :3].astype(np.float32)
        means = sample.reshape(-1, 3).mean(axis=0)
        spread = float(np.abs(sample[..., 0] - sample[..., 2]).mean() + np.abs(sample[..., 0] - sample[..., 1]).mean())
        if spread < 2.0:
            out.append(f"{where}: a grey image (its colour channels are equal), but the {task.name} bundle segments "
                       "colour fundus photographs; its masks are probably meaningless")
        elif means[0] < means[2]:
            out.append(f"{where}: more blue than red on average ({means[0]:.0f} vs {means[2]:.0f}); colour fundus "
                       "photographs are red-dominant, so this may not be one")
    return out


def screen_inputs(inputs: list[Any], source: Path) -> tuple[list[Any], list[dict[str, str]], dict[str, list[str]]]:
    """Split a run's inputs into those to segment, those skipped (with reasons) and per-input warnings.

    ``inputs`` are :mod:`engine.inference.run`'s ``_Input`` objects (``path``, ``volumetric``,
    ``is_dicom``). For a folder, masks are skipped (``{"input": file name, "reason"}``); for a
    single named file, the reasons become warnings (``"looks like ..."``, keyed by the path), which
    the caller prefixes with what it calls the input.
    """
    folder = source if source.is_dir() else source.parent
    masks = datalist_labels(folder)
    keep: list[Any] = []
    skipped: list[dict[str, str]] = []
    warnings: dict[str, list[str]] = {}
    for item in inputs:
        if item.is_dicom:
            keep.append(item)
            continue
        reason = None
        if os.path.realpath(item.path) in masks:
            reason = "a mask named by a datalist beside it (its 'label'), not an image"
        else:
            reason = label_map_reason(Path(item.path), bool(item.volumetric))
        if reason is None:
            keep.append(item)
        elif source.is_dir():
            skipped.append({"input": item.path.name, "reason": reason})  # the caller logs it, named or not
        else:
            keep.append(item)
            warnings.setdefault(str(item.path), []).append(f"looks like {reason}")
    return keep, skipped, warnings
