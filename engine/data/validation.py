"""Check a site's data before it trains: ``fedsm validate-data`` and the app's *Check data*.

For every entry of every section of each datalist:

- the image opens (:func:`engine.io.readers.open_study`) and is the task's kind (fundus: a photo,
  prostate: a volume);
- the mask opens onto the image (:func:`engine.io.masks.read_mask`): it exists, is readable, has
  the image's size and geometry (a mask on part of the image is a problem here), and its values
  are the ones the label convention uses;
- no image is listed twice (a case in two splits leaks test data into training).

Warnings do not fail the check: an empty mask, a fundus mask without cup, a cup outside its disc,
drishti soft maps with in-between greys. A file a reader fails on with anything but a
:class:`~engine.errors.DataError` (a reader bug) is a problem of its entry too, its traceback
logged, so one odd file never stops the check of the others. The report is plain JSON-able data
(see :func:`validate_datalists`); ``ok`` is true when no entry and no datalist has a problem.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.data.datalist import SECTIONS, load_datalist_with_info
from engine.errors import ConfigError, DataError
from engine.io import masks
from engine.io.label_conventions import DATALIST_KEY, DRISHTI_THRESHOLD, LabelConvention, convention_for, get_convention
from engine.io.masks import read_label_image
from engine.io.readers import open_study
from engine.tasks import TASKS

log = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
ProgressFn = Callable[[dict[str, Any]], None]

#: Task -> the study kind its images must be.
_KIND = {"fundus": "photo", "prostate": "volume"}


def _check_entry(entry: dict[str, Any], task: str | None, convention: LabelConvention | None
                 ) -> tuple[dict[str, Any], str | None]:
    """Problems, warnings and facts of one datalist entry; also the study kind (to infer the task)."""
    image, label = Path(entry["image"]), Path(entry["label"])
    row: dict[str, Any] = {"file": str(image), "image": str(image), "label": str(label), "ok": True,
                           "problems": [], "warnings": []}
    try:
        study = open_study(image)
    except DataError as exc:
        row["problems"].append(f"image: {exc}")
        if not label.exists():
            row["problems"].append(f"mask: {label}: not found")
        return row, None
    except Exception as exc:  # a reader bug must not stop the check of every other file
        row["problems"].append(f"image: {_unexpected(image, exc)}")
        return row, None
    row["kind"] = study.kind
    row["shape"] = [int(n) for n in study.shape]
    if study.kind == "volume":
        row["slices"] = study.num_slices
    if task is not None and study.kind != _KIND[task]:
        row["problems"].append(f"image: {image} is a {study.kind}, but {task} images are {_KIND[task]}s; "
                               f"choose the {task} datalist or task")
        return row, study.kind
    try:
        reading = masks.read_mask(label, study, convention, allow_partial=False)
    except DataError as exc:
        row["problems"].append(f"mask: {exc}")
        return row, study.kind
    except Exception as exc:  # a reader bug must not stop the check of every other file
        row["problems"].append(f"mask: {_unexpected(label, exc)}")
        return row, study.kind
    labels = reading.labels.array
    row["values"] = sorted({v for file_values in reading.raw_values for v in file_values})
    if convention is not None:
        for values in reading.raw_values:
            bad = convention.unexpected_values(values)
            if not bad:
                continue
            if convention.name == "binary":
                row["problems"].append(f"mask: {label} has several non-zero values {bad[:8]}; a binary mask has one "
                                       "(e.g. 0/1 or 0/255) — use --convention multilabel for a multi-label map")
            elif convention.strict:
                row["problems"].append(f"mask: {label} has values {bad[:8]} the {convention.name} convention does not "
                                       "use; map them, or choose the dataset's convention")
            else:
                row["warnings"].append(f"mask: {label} has values {bad[:8]} besides the {convention.name} convention's "
                                       f"{sorted(convention.expected_values or [])}; they are binarised as usual")
    if not labels.any():
        row["warnings"].append(f"mask: {label} is empty (no structure marked)")
    elif task == "fundus":
        if not (labels == 2).any():
            row["warnings"].append(f"mask: {label} has a disc but no cup")
    if convention is not None and convention.name == "drishti":
        _check_drishti_nesting(convention, label, row)
    return row, study.kind


def _unexpected(path: Path, exc: Exception) -> str:
    """A problem line for an error the readers did not turn into a DataError; the traceback goes to the log."""
    log.error("%s: unexpected %s while reading it", path, type(exc).__name__, exc_info=exc)
    return (f"{path}: cannot be read ({type(exc).__name__}: {exc}); check the file or copy it again, and report this "
            "message to the FedSM developers (the reader should have explained it)")


def _check_drishti_nesting(convention: LabelConvention, label: Path, row: dict[str, Any]) -> None:
    """Warn when cup pixels (by majority) lie outside the disc (by majority): the maps may be swapped."""
    disc_path, cup_path = convention.label_files(label)
    disc, cup = read_label_image(disc_path), read_label_image(cup_path)
    outside = int(((cup >= DRISHTI_THRESHOLD) & (disc < DRISHTI_THRESHOLD)).sum())
    if outside:
        row["warnings"].append(f"mask: {cup_path.name} marks {outside} cup pixels outside the disc of "
                               f"{disc_path.name}; check the two maps are not swapped")


def _site_task(task: str | None, stated: object, path: Path) -> tuple[str | None, str | None]:
    """The task to check against and a problem when ``--task`` and the datalist disagree."""
    stated_task = stated if isinstance(stated, str) and stated else None
    if stated_task is not None and stated_task not in TASKS:
        return task, f"{path}: names task {stated_task!r}, which FedSM does not know (known: {', '.join(TASKS)})"
    if task is not None and stated_task is not None and task != stated_task:
        return task, f"{path}: this datalist is for task {stated_task!r}, not {task!r}; choose the {task} datalist"
    return task or stated_task, None


def validate_datalist(path: PathLike, convention: str | None = None, task: str | None = None,
                      progress: ProgressFn | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check one datalist; return its site summary and its per-entry rows (see :func:`validate_datalists`)."""
    p = Path(path)
    site: dict[str, Any] = {"datalist": str(p), "name": p.absolute().parent.name, "task": task, "convention": None,
                            "counts": {}, "problems": []}
    try:
        sections, info = load_datalist_with_info(p)
    except DataError as exc:
        site["problems"].append(str(exc))
        return site, []
    if isinstance(info.get("name"), str) and info["name"]:
        site["name"] = info["name"]
    site_task, problem = _site_task(task, info.get("task"), p)
    if problem:
        site["problems"].append(problem)
    entries = [(section, i, entry) for section in SECTIONS for i, entry in enumerate(sections.get(section, []))]
    if not sections.get("training"):
        site["problems"].append(f"{p}: the 'training' section is empty; list at least one image and its mask")
    conv: LabelConvention | None = None
    if site_task is not None:
        try:
            conv = convention_for(site_task, info.get(DATALIST_KEY), convention)
        except ConfigError as exc:
            site["problems"].append(f"{p}: {exc}")
    rows: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for done, (section, i, entry) in enumerate(entries, start=1):
        row, kind = _check_entry(entry, site_task, conv)
        if site_task is None and kind is not None:
            # No task given or stated: the first readable image decides; re-check this entry with it.
            site_task = "fundus" if kind == "photo" else "prostate"
            try:
                conv = convention_for(site_task, info.get(DATALIST_KEY), convention)
            except ConfigError as exc:
                site["problems"].append(f"{p}: {exc}")
            row, kind = _check_entry(entry, site_task, conv)
        where = f"{section}[{i}]"
        key = os.path.normcase(str(Path(entry["image"]).absolute()))
        if key in seen:
            row["problems"].append(f"image: listed twice ({seen[key]} and {where}); a case belongs to one split only")
        seen.setdefault(key, where)
        row.update(site=site["name"], datalist=str(p), split=section, index=i)
        row["ok"] = not row["problems"]
        rows.append(row)
        if progress is not None:
            progress({"event": "status", "message": f"Checked {Path(entry['image']).name}", "done": done,
                      "total": len(entries)})
    site["task"] = site_task
    site["convention"] = conv.name if conv is not None else None
    for section in SECTIONS:
        members = [r for r in rows if r["split"] == section]
        if section in sections:
            counts: dict[str, int] = {"cases": len(members), "ok": sum(r["ok"] for r in members)}
            if any("slices" in r for r in members):
                counts["slices"] = int(sum(r.get("slices", 0) for r in members))
            site["counts"][section] = counts
    site["ok"] = not site["problems"] and all(r["ok"] for r in rows)
    return site, rows


def validate_datalists(datalists: list[PathLike], convention: str | None = None, task: str | None = None,
                       progress: ProgressFn | None = None) -> dict[str, Any]:
    """Check site datalists; a JSON-able report.

    Parameters
    ----------
    datalists
        Datalist JSON files (one per site).
    convention
        Label convention for every datalist (overrides their ``"label_convention"`` key); ``None``:
        each datalist's own, else its task's default.
    task
        ``"fundus"`` or ``"prostate"``; ``None``: each datalist's ``"task"``, else inferred from its
        first readable image.

    Returns
    -------
    dict
        ``{"ok": bool, "summary": str, "sites": [...], "files": [...], "problems": int,
        "warnings": int}``. A site: ``datalist``, ``name``, ``task``, ``convention``, ``counts``
        (per section: ``cases``, ``ok``, and ``slices`` for volumes), ``problems`` (datalist-level
        messages), ``ok``. A file row: ``site``, ``datalist``, ``split``, ``index``, ``file``
        (= ``image``), ``label``, ``ok``, ``problems``, ``warnings``, and when readable ``kind``,
        ``shape``, ``slices``, ``values`` (raw mask values).

    Raises
    ------
    ConfigError
        When ``task`` or ``convention`` is not a known name.
    """
    if task is not None and task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    if convention is not None:
        get_convention(convention)
    sites, files = [], []
    for path in datalists:
        site, rows = validate_datalist(path, convention=convention, task=task, progress=progress)
        sites.append(site)
        files.extend(rows)
    bad_files = sum(not r["ok"] for r in files)
    bad_sites = sum(bool(s["problems"]) for s in sites)
    problems = sum(len(r["problems"]) for r in files) + sum(len(s["problems"]) for s in sites)
    warnings = sum(len(r["warnings"]) for r in files)
    ok = problems == 0
    state = "ready to train" if ok else "fix the files marked"
    summary = f"{len(files)} file(s) checked in {len(sites)} datalist(s), {bad_files} with problems"
    if bad_sites:
        summary += f", {bad_sites} datalist(s) with problems"
    summary += f", {warnings} warning(s): {state}"
    return {"ok": ok, "summary": summary, "sites": sites, "files": files, "problems": problems,
            "warnings": warnings}
