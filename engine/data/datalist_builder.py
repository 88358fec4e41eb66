"""``fedsm datalist``: a site's datalist built from a folder of images and a folder of masks.

Name-matching rule (documented in ``docs/io.md``, "Building a datalist")
------------------------------------------------------------------------
An *image* is a file in the image folder with an image or volume suffix (``.png .jpg .jpeg
.tif .tiff .bmp .nii .nii.gz .mha .mhd .nrrd .dcm``) or a sub-folder (a DICOM series). Its *stem*
is the name without that suffix (``case7.nii.gz`` -> ``case7``). A *mask* matches an image when,
in the mask folder (searched without sub-folders), its stem

1. equals the image's stem plus ``--mask-suffix`` when one is given (``case7`` + ``_seg``), else
2. equals the image's stem, or starts with it followed by ``_``, ``-`` or ``.`` (``case7_mask``).

With the ``drishti`` convention only disc maps (``*_ODsegSoftmap*``) are candidates; their cup maps
are found beside them when the data is read. An image with no matching mask is skipped and listed
in the result; one with several is an error naming them (give ``--mask-suffix``).

Split
-----
Entries are grouped into cases (``--case-pattern``: a regular expression whose first group, found
in the image's stem, is the case id; default: the stem itself, one image = one case), the cases are
shuffled with ``numpy.random.default_rng(seed)`` and cut into training, validation and testing by
the fractions given (largest remainder, each non-zero fraction gets at least one case when there
are enough), so every image of a case lands in the same split and the same seed gives the same file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.bundle.supermodel import check_site_name
from engine.data.datalist import write_datalist
from engine.errors import ConfigError, DataError
from engine.io.label_conventions import CONVENTIONS, DATALIST_KEY, convention_for
from engine.tasks import get_task

#: Suffixes of files that can be an image or a mask, longest first (``.nii.gz`` before ``.gz``).
SUFFIXES = (".nii.gz", ".nii", ".mha", ".mhd", ".nrrd", ".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".dcm")
#: Separators allowed between an image's stem and a mask's extra words.
SEPARATORS = ("_", "-", ".")
_DRISHTI_DISC = re.compile(r"ODsegSoftmap", re.IGNORECASE)


@dataclass
class BuildResult:
    """What :func:`build_datalist` wrote.

    Attributes
    ----------
    path
        The datalist file.
    counts
        Entries per section, e.g. ``{"training": 4, "validation": 1, "testing": 1}``.
    unmatched
        Images that had no mask (skipped).
    convention, task
        The label convention and task written into the datalist.
    """

    path: Path
    counts: dict[str, int]
    unmatched: list[Path] = field(default_factory=list)
    convention: str = ""
    task: str = ""


def split_stem(path: Path) -> tuple[str, str] | None:
    """``(stem, suffix)`` of a file with a known suffix (case-insensitive), else ``None``."""
    lower = path.name.lower()
    for suffix in SUFFIXES:
        if lower.endswith(suffix) and len(lower) > len(suffix):
            return path.name[: -len(suffix)], suffix
    return None


def _images(folder: Path) -> list[tuple[str, Path]]:
    out = []
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            out.append((child.name, child))
            continue
        parts = split_stem(child)
        if parts is not None:
            out.append((parts[0], child))
    return out


def _masks(folder: Path, convention: str) -> list[tuple[str, Path]]:
    out = []
    for child in sorted(folder.iterdir()):
        parts = split_stem(child) if child.is_file() and not child.name.startswith(".") else None
        if parts is None:
            continue
        if convention == "drishti" and not _DRISHTI_DISC.search(parts[0]):
            continue
        out.append((parts[0], child))
    return out


def match_masks(images: Sequence[tuple[str, Path]], masks: Sequence[tuple[str, Path]],
                mask_suffix: str | None = None) -> tuple[list[tuple[str, Path, Path]], list[Path]]:
    """Pair images with masks by the module's name-matching rule.

    Returns
    -------
    tuple
        ``([(stem, image, mask), ...], [unmatched image, ...])``.

    Raises
    ------
    DataError
        When an image matches several masks.
    """
    pairs: list[tuple[str, Path, Path]] = []
    unmatched: list[Path] = []
    for stem, image in images:
        if mask_suffix is not None:
            found = [m for s, m in masks if s == stem + mask_suffix]
        else:
            exact = [m for s, m in masks if s == stem]
            found = exact or [m for s, m in masks if any(s.startswith(stem + sep) for sep in SEPARATORS)]
        if len(found) > 1:
            names = ", ".join(m.name for m in found[:5])
            raise DataError(f"{image}: several masks match this image ({names}); give --mask-suffix (e.g. "
                            f"--mask-suffix {found[0].name[len(stem):].split('.')[0]!r}) to say which one")
        if found:
            pairs.append((stem, image, found[0]))
        else:
            unmatched.append(image)
    return pairs, unmatched


def split_cases(case_ids: Sequence[str], fractions: Sequence[float], seed: int) -> list[int]:
    """Section index (0 training, 1 validation, 2 testing) of every entry, by case, seeded.

    Raises
    ------
    ConfigError
        When the fractions are not three non-negative numbers with a positive training share.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or fractions[0] <= 0:
        raise ConfigError(f"--split needs three non-negative fractions TRAIN,VAL,TEST with TRAIN > 0, got "
                          f"{','.join(map(str, fractions))}")
    total = float(sum(fractions))
    shares = [f / total for f in fractions]
    cases = sorted(set(case_ids))
    order = [cases[i] for i in np.random.default_rng(seed).permutation(len(cases))]
    n = len(cases)
    exact = [s * n for s in shares]
    counts = [int(np.floor(e)) for e in exact]
    for i in sorted(range(3), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    # a non-zero share gets a case when there are enough to keep one for training
    for i in (1, 2):
        if shares[i] > 0 and counts[i] == 0 and counts[0] > 1:
            counts[0] -= 1
            counts[i] += 1
    section_of: dict[str, int] = {}
    start = 0
    for section, count in enumerate(counts):
        for case in order[start:start + count]:
            section_of[case] = section
        start += count
    return [section_of[c] for c in case_ids]


def _case_id(stem: str, pattern: re.Pattern[str] | None) -> str:
    if pattern is None:
        return stem
    m = pattern.search(stem)
    if m is None:
        raise DataError(f"image {stem!r}: --case-pattern {pattern.pattern!r} does not match its name; fix the "
                        "pattern (its first group is the case id) or leave it out (one image = one case)")
    return m.group(1) if m.groups() else m.group(0)


def _guess_task(image: Path) -> str:
    parts = split_stem(image)
    suffix = parts[1] if parts else ""
    return "fundus" if suffix in (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp") else "prostate"


def _inside(path: Path, folder: Path) -> bool:
    real = os.path.realpath(path)
    base = os.path.realpath(folder)
    return os.path.commonpath([real, base]) == base


def build_datalist(images_dir: Path, masks_dir: Path, out: Path, *, task: str | None = None,
                   convention: str | None = None, name: str | None = None,
                   split: Sequence[float] = (0.6, 0.2, 0.2), seed: int = 0, mask_suffix: str | None = None,
                   case_pattern: str | None = None, allow_outside: bool = False) -> BuildResult:
    """Match images with masks, split by case and write the datalist ``out`` (see the module docstring).

    Parameters
    ----------
    images_dir, masks_dir
        Folders of images (or DICOM series sub-folders) and of masks.
    out
        The datalist JSON to write; its paths are relative to its folder.
    task
        ``"fundus"`` or ``"prostate"``; default from the first image (photo: fundus, volume: prostate).
    convention
        Label convention; default ``drishti`` when the masks are Drishti-GS disc/cup soft maps, else
        the task's default.
    name
        Site name written into the datalist (default: the datalist's folder name, when allowed).
    split
        Fractions of cases for training, validation and testing.
    seed
        Seed of the case shuffle.
    mask_suffix
        When given, a mask's stem must be exactly the image's stem plus this.
    case_pattern
        Regular expression whose first group in an image's stem is its case id.
    allow_outside
        Allow images or masks outside the datalist's folder (written as ``../`` or absolute paths).

    Raises
    ------
    DataError
        When a folder is missing, nothing matches, an image has several masks, or files lie outside
        the datalist's folder without ``allow_outside``.
    ConfigError
        When the task, convention, split or pattern is invalid.
    """
    images_dir, masks_dir, out = Path(images_dir), Path(masks_dir), Path(out)
    for label, folder in (("image", images_dir), ("mask", masks_dir)):
        if not folder.is_dir():
            raise DataError(f"{folder}: {label} folder not found; give the folder that holds the {label}s")
    if out.is_dir():
        raise DataError(f"{out}: is a folder; give the datalist's file name, e.g. {out / 'datalist.json'}")
    pattern = None
    if case_pattern:
        try:
            pattern = re.compile(case_pattern)
        except re.error as exc:
            raise ConfigError(f"--case-pattern {case_pattern!r} is not a valid regular expression ({exc})") from exc
    images = _images(images_dir)
    if not images:
        raise DataError(f"{images_dir}: no images found (suffixes {', '.join(SUFFIXES)} or DICOM series folders)")
    if convention is None and any(_DRISHTI_DISC.search(s) for s, _ in _masks(masks_dir, "")):
        convention = "drishti"
    if task is None:
        task = _guess_task(images[0][1])
    get_task(task)
    conv = convention_for(task, convention)
    if conv.name not in CONVENTIONS:  # pragma: no cover - convention_for only returns known ones
        raise ConfigError(f"unknown convention {conv.name!r}")
    pairs, unmatched = match_masks(images, _masks(masks_dir, conv.name), mask_suffix)
    if not pairs:
        raise DataError(f"no image in {images_dir} has a mask in {masks_dir} (a mask's name is the image's name, "
                        "optionally followed by '_', '-' or '.' and more; or give --mask-suffix)")
    base = out.absolute().parent
    if not allow_outside:
        outside = [p for _, i, m in pairs for p in (i, m) if not _inside(p.absolute(), base)]
        if outside:
            raise DataError(f"{outside[0]} lies outside the datalist's folder {base}; write the datalist in a "
                            "folder that holds the images and masks, or pass --allow-outside")
    if name is None:
        name = re.sub(r"[^A-Za-z0-9_-]", "-", base.name) or "site"
    check_site_name(name)
    sections_of = split_cases([_case_id(stem, pattern) for stem, _, _ in pairs], split, seed)
    sections: dict[str, list[dict[str, Any]]] = {"training": [], "validation": [], "testing": []}
    keys = list(sections)
    for (stem, image, mask), section in zip(pairs, sections_of, strict=True):
        entry: dict[str, Any] = {"image": image.absolute(), "label": mask.absolute()}
        if pattern is not None:
            entry["case"] = _case_id(stem, pattern)
        sections[keys[section]].append(entry)
    write_datalist(out, sections, info={"name": name, "task": task, DATALIST_KEY: conv.name})
    return BuildResult(out, {k: len(v) for k, v in sections.items()}, unmatched, conv.name, task)


def find_datalists(paths: Sequence[Path]) -> list[Path]:
    """The site datalists named by ``fedsm simulate --data``: files as given, folders searched.

    A folder contributes ``*.json`` files directly inside it and ``*/datalist.json`` one level down,
    keeping those whose top level is a JSON object with a ``"training"`` list (``federation.json`` and
    other JSON files are passed over). Order: as given, each folder's finds sorted by path.

    Raises
    ------
    DataError
        When a path does not exist, or a folder holds no datalist (the message says how to make one).
    """
    found: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            found.append(p)
            continue
        if not p.is_dir():
            raise DataError(f"{p}: not found; give a folder of site datalists or datalist JSON files")
        candidates = sorted(p.glob("*.json")) + sorted(p.glob("*/datalist.json"))
        here = []
        for c in candidates:
            try:
                doc = json.loads(c.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if isinstance(doc, dict) and isinstance(doc.get("training"), list):
                here.append(c)
        if not here:
            raise DataError(f"{p}: holds no datalist (looked for {p}/*.json and {p}/*/datalist.json with a "
                            "'training' list); build one per site with 'fedsm datalist --images ... --masks ... "
                            "--out SITE/datalist.json', or leave --data out to train on synthetic data")
        found.extend(here)
    return found
