"""``fedsm validate-data``: check site datalists before training (every image has a usable mask).

Prints per-site and per-split counts, then one line per problem (and warning) with the entry it
belongs to; ``--json`` prints the report of :func:`engine.api.validate_data` instead. Exit status
0 when everything is usable, 1 when any entry or datalist has a problem (2, as for every command,
when the arguments themselves are wrong).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from engine import api
from engine.cli.common import setup_logging
from engine.data.datalist import outside_paths_allowed
from engine.io.label_conventions import CONVENTIONS
from engine.io.masks import set_orientation_tolerance


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``validate-data`` to the ``fedsm`` parser."""
    p = sub.add_parser(
        "validate-data", help="check site datalists: every image has its mask, sizes, geometry and label values",
        description="Check that every image of each datalist opens, has its mask, that sizes and geometry match "
                    "and mask values are the label convention's. Exit status 0 when all is usable, 1 otherwise.")
    p.add_argument("datalists", nargs="+", type=Path, metavar="DATALIST", help="a site's datalist JSON")
    p.add_argument("--convention", choices=sorted(CONVENTIONS), default=None,
                   help="label convention of the masks (default: the datalist's 'label_convention', else the "
                        "task's: origa for fundus, binary for prostate); "
                        + "; ".join(f"{c.name}: {c.summary}" for c in CONVENTIONS.values()))
    p.add_argument("--task", choices=["fundus", "prostate"], default=None,
                   help="the task the data is for (default: the datalist's 'task', else from its first image)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    add_allow_outside(p)
    add_orientation_option(p)
    p.set_defaults(handler=validate_data_command)


def add_orientation_option(p: argparse.ArgumentParser) -> None:
    """``--tolerate-orientation DEG``: accept masks on the image's grid whose orientation header differs slightly."""
    p.add_argument("--tolerate-orientation", type=float, default=0.0, metavar="DEG",
                   help="accept a label volume whose orientation differs from its image's by up to DEG degrees "
                        "when it is otherwise on the image's voxel grid (same shape, spacing and origin); it is "
                        "taken voxel for voxel, never resampled (default 0: refused, the message gives the angle)")


def apply_orientation_option(args: argparse.Namespace) -> None:
    """Set the process-wide mask orientation tolerance from ``--tolerate-orientation``."""
    set_orientation_tolerance(getattr(args, "tolerate_orientation", 0.0))


def add_allow_outside(p: argparse.ArgumentParser) -> None:
    """Add ``--allow-outside`` (datalists may name files outside their own folder) to a command."""
    p.add_argument("--allow-outside", action="store_true",
                   help="let datalists name files outside their own folder (absolute paths, '..', symbolic "
                        "links); by default every image and mask must lie inside the datalist's folder")


def _short(path: str, base: Path) -> str:
    """A path relative to the datalist's folder when it lies below it."""
    try:
        rel = os.path.relpath(path, base)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def format_report(report: dict[str, Any]) -> str:
    """The report as terminal text: a block per site, then problems and warnings per entry."""
    lines: list[str] = []
    for site in report["sites"]:
        task = site.get("task") or "task unknown"
        convention = f", labels {site['convention']}" if site.get("convention") else ""
        lines.append(f"{site['name']} ({task}{convention}): {site['datalist']}")
        counts = []
        for section, c in site["counts"].items():
            text = f"{section} {c['cases']} case(s)"
            if "slices" in c:
                text += f", {c['slices']} slices"
            if c["ok"] != c["cases"]:
                text += f", {c['cases'] - c['ok']} with problems"
            counts.append(text)
        lines.append("  " + ("; ".join(counts) if counts else "no entries"))
        for problem in site["problems"]:
            lines.append(f"  PROBLEM {problem}")
        base = Path(site["datalist"]).absolute().parent
        for row in (r for r in report["files"] if r["datalist"] == site["datalist"]):
            where = f"{row['split']}[{row['index']}] {_short(row['image'], base)} + {_short(row['label'], base)}"
            for problem in row["problems"]:
                lines.append(f"  PROBLEM {where}: {problem}")
            for warning in row["warnings"]:
                lines.append(f"  warning {where}: {warning}")
    lines.append(report["summary"])
    return "\n".join(lines)


def validate_data_command(args: argparse.Namespace) -> int:
    """Handler of ``fedsm validate-data``."""
    setup_logging(args.verbose)
    apply_orientation_option(args)
    with outside_paths_allowed(args.allow_outside):
        report = api.validate_data(args.datalists, convention=args.convention, task=args.task)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1
