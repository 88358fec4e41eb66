"""``fedsm evaluate``: a bundle's Dice and HD95 against the expert masks of site datalists.

Every image of the chosen datalist section is opened with the engine's readers, segmented exactly
as ``fedsm infer`` and the desktop app segment it (:func:`engine.inference.study.segment_with`,
so at the image's own resolution, not the network's), and compared with its mask read through the
datalist's label convention. Metrics are MONAI's, per structure (fundus: disc, cup; prostate:
gland):

- Dice: :func:`monai.metrics.compute_dice` with ``ignore_empty=False`` (an image where both the
  prediction and the expert mask are empty scores 1);
- HD95: :func:`monai.metrics.compute_hausdorff_distance` with ``percentile=95`` and the study's
  pixel spacing (photos: pixels; volumes: millimetres); ``None`` when either mask is empty.

A site's figure is the mean over its images; the overall figure is the mean over sites (client
average, as in the FedSM paper).

Model choices: ``routed`` (the selector picks per image, as in use), ``global``, ``personal`` (each
site's own personalized model, matched by the datalist's ``name``; the oracle routing),
``personal:SITE`` (that site's model on every datalist) and ``all`` (routed, global, personal).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.metrics import compute_dice, compute_hausdorff_distance

from engine.data.datalist import load_datalist_with_info
from engine.data.preprocess import label_channels, read_task_channels
from engine.errors import ConfigError, DataError
from engine.inference.study import load_predictor, segment_with
from engine.io.atomic import write_text_atomic
from engine.io.label_conventions import DATALIST_KEY, convention_for
from engine.io.privacy import neutral_name
from engine.io.readers import open_study
from engine.tasks import get_task

PathLike = str | os.PathLike[str]
SPLITS = ("training", "validation", "testing")
SCHEMA = "fedsm-evaluation/1"


def parse_model_choice(choice: str, site_names: Sequence[str]) -> list[str]:
    """``routed|global|personal|personal:SITE|all`` -> the choices to evaluate, checked against the bundle.

    Raises
    ------
    ConfigError
        For an unknown choice, or a personalized model the bundle does not hold.
    """
    text = str(choice).strip()
    if text == "all":
        return ["routed", "global", "personal"] if site_names else ["global"]
    if text in ("routed", "global"):
        return [text]
    if text == "personal" or text.startswith("personal:"):
        if not site_names:
            raise ConfigError("this bundle holds one global model and no personalized models; use --model-choice "
                              "global (or routed, which is the same here)")
        site = text.partition(":")[2]
        if site and site not in site_names:
            raise ConfigError(f"the bundle has no personalized model of site {site!r}; its sites are "
                              f"{', '.join(site_names)}")
        return [text]
    raise ConfigError(f"unknown --model-choice {choice!r}; use routed, global, personal, personal:SITE "
                      f"({', '.join(site_names) or 'no sites in this bundle'}) or all")


def structure_metrics(pred: np.ndarray, truth: np.ndarray, spacing: Sequence[float]) -> tuple[list[float],
                                                                                             list[float | None]]:
    """Dice and HD95 per channel of binary ``(L, *spatial)`` masks, with MONAI's metrics.

    Returns
    -------
    tuple
        ``([dice per channel], [hd95 per channel or None when either mask is empty])``.
    """
    p = torch.from_numpy(np.ascontiguousarray(pred > 0, dtype=np.float32))[None]
    t = torch.from_numpy(np.ascontiguousarray(truth > 0, dtype=np.float32))[None]
    dice = compute_dice(p, t, include_background=True, ignore_empty=False)[0].tolist()
    hd: list[float | None] = []
    for c in range(p.shape[1]):
        if not bool(p[0, c].any()) or not bool(t[0, c].any()):
            hd.append(None)
            continue
        with warnings.catch_warnings():  # MONAI 1.5+ warns about its own internal use of a deprecated argument
            warnings.simplefilter("ignore", FutureWarning)
            value = compute_hausdorff_distance(p[:, c:c + 1], t[:, c:c + 1], include_background=True,
                                               percentile=95, spacing=[float(s) for s in spacing])
        v = float(value.reshape(-1)[0])
        hd.append(v if math.isfinite(v) else None)
    return [float(d) for d in dice], hd


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(kept)) if kept else None


def _force_for(choice: str, site: str, site_names: Sequence[str]) -> str | None:
    if choice == "routed":
        return None
    if choice == "global":
        return "global"
    own = choice.partition(":")[2] or site
    if own not in site_names:
        raise ConfigError(f"datalist site {site!r} has no personalized model in this bundle (its sites are "
                          f"{', '.join(site_names)}); use --model-choice personal:SITE to pick one, or name the "
                          "datalist's site as in the federation")
    return own


def evaluate_bundle(model: PathLike, datalists: Sequence[PathLike], split: str = "testing",
                    model_choice: str = "routed", gamma: float | None = None, device: str = "auto",
                    progress: Callable[[str], None] | None = None, keep_names: bool = False,
                    name_map: PathLike | None = None) -> dict[str, Any]:
    """Evaluate a bundle on site datalists (see the module docstring); a JSON-able report.

    Per-image rows name each image by the hash of its content (``"case": "case-3f2a9c01d4"``,
    :func:`engine.io.privacy.neutral_name`), since file names often name patients; ``keep_names``
    records the image and mask paths instead (``"image"``, ``"label"``). ``name_map``: a file to
    write ``{case: image path}`` to (JSON).

    Returns
    -------
    dict
        ``{"schema", "bundle", "split", "labels", "choices": {choice: {"sites": {site: {...}},
        "client_average": {...}}}, "images": [per-image rows]}``; a site's entry holds ``images``,
        ``dice``/``hd95`` per structure (means) and ``routing`` (images per model).

    Raises
    ------
    DataError
        Missing or broken datalists, files or masks, a datalist for another task, an empty split.
    ConfigError, BundleError
        Bad choice or gamma; an unreadable bundle.
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if not datalists:
        raise ConfigError("no datalist given; name at least one site datalist")
    loaded = load_predictor(model, device)
    meta = loaded.predictor.metadata
    task = get_task(meta.task)
    site_names = list(meta.personal_sites)  # sites with a personalized model (none in a single-model bundle)
    choices = parse_model_choice(model_choice, site_names)
    if not site_names:
        choices = ["global" if c == "routed" else c for c in choices]
        choices = list(dict.fromkeys(choices))

    sites: list[tuple[str, Path, list[dict[str, Any]], Any]] = []
    for raw in datalists:
        path = Path(raw)
        sections, info = load_datalist_with_info(path)
        stated = info.get("task")
        if isinstance(stated, str) and stated != task.name:
            raise DataError(f"{path}: this datalist is for task {stated!r} but the bundle segments {task.name!r}; "
                            "choose a bundle of that task")
        entries = sections.get(split, [])
        if not entries:
            raise DataError(f"{path}: the {split!r} section is empty or absent; choose another --split or list "
                            "images there (fedsm datalist --split)")
        name = info.get("name") if isinstance(info.get("name"), str) else path.absolute().parent.name
        try:
            convention = convention_for(task.name, info.get(DATALIST_KEY))
        except ConfigError as exc:
            raise DataError(f"{path}: {exc}") from exc
        sites.append((str(name), path, entries, convention))

    labels = list(task.label_names)
    cases: dict[str, str] = {}  # case -> image, for name_map
    rows: list[dict[str, Any]] = []
    per_choice: dict[str, dict[str, Any]] = {c: {"sites": {}} for c in choices}
    for name, path, entries, convention in sites:
        site_rows: dict[str, list[dict[str, Any]]] = {c: [] for c in choices}
        for number, entry in enumerate(entries, start=1):
            image_path = Path(entry["image"])
            if progress is not None:
                progress(f"{name}: {image_path.name}" if keep_names else f"{name}: image {number} of {len(entries)}")
            study = open_study(image_path)
            if keep_names:
                named: dict[str, Any] = {"image": str(image_path), "label": str(entry["label"])}
            else:
                case = neutral_name(study)
                cases.setdefault(case, str(image_path))
                named = {"case": case}
            truth = read_task_channels(task, entry["label"], study, convention)
            spacing = tuple(float(s) for s in study.spacing)
            for choice in choices:
                seg = segment_with(loaded, study, gamma=gamma, force_model=_force_for(choice, name, site_names))
                pred = label_channels(task, seg.labels.array)
                dice, hd = structure_metrics(pred, truth, spacing)
                records = seg.records
                row = {"choice": choice, "site": name, **named,
                       "dice": dict(zip(labels, dice, strict=True)), "hd95": dict(zip(labels, hd, strict=True)),
                       "models": seg.models_used,
                       # the selector's confidence means something only where it chose the model
                       "confidence": (float(np.mean([r.confidence for r in records]))
                                      if records and choice == "routed" and not meta.single_model else None)}
                rows.append(row)
                site_rows[choice].append(row)
        for choice, items in site_rows.items():
            routing: dict[str, int] = {}
            for r in items:
                for m, n in r["models"].items():
                    routing[m] = routing.get(m, 0) + n
            per_choice[choice]["sites"][name] = {
                "datalist": str(path), "images": len(items),
                "dice": {lb: _mean([r["dice"][lb] for r in items]) for lb in labels},
                "hd95": {lb: _mean([r["hd95"][lb] for r in items]) for lb in labels},
                "routing": dict(sorted(routing.items())),
            }
    for doc in per_choice.values():
        doc["client_average"] = {
            "dice": {lb: _mean([s["dice"][lb] for s in doc["sites"].values()]) for lb in labels},
            "hd95": {lb: _mean([s["hd95"][lb] for s in doc["sites"].values()]) for lb in labels},
        }
    if name_map is not None:
        write_text_atomic(Path(name_map), json.dumps(cases, indent=2) + "\n")
    return {"schema": SCHEMA, "names": "kept" if keep_names else "neutral",
            "bundle": {"name": loaded.name, "sha256": loaded.sha256, "method": meta.method,
                       "task": meta.task, "sites": list(meta.site_names), "routing": meta.routing,
                       "gamma": meta.gamma if gamma is None else gamma},
            "split": split, "labels": labels, "hd95_unit": "mm" if task.volumetric else "pixels",
            "choices": per_choice, "images": rows}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_evaluation(report: dict[str, Any]) -> str:
    """The report as terminal text: a per-site table per model choice, then every image's routing."""
    labels = report["labels"]
    unit = report["hd95_unit"]
    head = ["model", "site", "images", *[f"{lb} Dice" for lb in labels], *[f"{lb} HD95 ({unit})" for lb in labels],
            "segmented by"]
    table: list[list[str]] = []
    for choice, doc in report["choices"].items():
        for site, s in doc["sites"].items():
            routing = ", ".join(f"{m} {n}" for m, n in s["routing"].items())
            table.append([choice, site, str(s["images"]), *[_fmt(s["dice"][lb]) for lb in labels],
                          *[_fmt(s["hd95"][lb], 1) for lb in labels], routing])
        avg = doc["client_average"]
        table.append([choice, "(site mean)", "", *[_fmt(avg["dice"][lb]) for lb in labels],
                      *[_fmt(avg["hd95"][lb], 1) for lb in labels], ""])
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    lines = [f"bundle {report['bundle']['name']} ({report['bundle']['method']}, sha256 "
             f"{report['bundle']['sha256'][:12]}), split {report['split']}"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines.append("")
    lines.append("per image:")
    for r in report["images"]:
        dice = ", ".join(f"{lb} {_fmt(r['dice'][lb])}" for lb in labels)
        models = ", ".join(f"{m}" + (f" x{n}" if n > 1 else "") for m, n in r["models"].items())
        how = "routed to" if r["confidence"] is not None else "segmented by"
        conf = "" if r["confidence"] is None else f" (selector confidence {r['confidence']:.2f})"
        shown = r["case"] if "case" in r else Path(r["image"]).name
        lines.append(f"  {r['choice']:<9} {r['site']}: {shown}: Dice {dice}; {how} {models}{conf}")
    return "\n".join(lines)
