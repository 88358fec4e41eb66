"""``fedsm datalist`` and ``fedsm evaluate``: a site's own data from folders to measured Dice.

``datalist`` builds a MONAI-style datalist from a folder of images and a folder of masks
(:mod:`engine.data.datalist_builder`); ``evaluate`` measures a bundle's Dice and HD95 against the
expert masks of one or more datalists (:mod:`engine.inference.evaluate`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine import api
from engine.bundle import check_bundle_file
from engine.cli.common import add_name_options, set_threads, setup_logging
from engine.cli.data_commands import add_allow_outside
from engine.cli.main import add_threads_option
from engine.data.datalist import outside_paths_allowed
from engine.errors import ConfigError
from engine.io.atomic import write_text_atomic
from engine.io.label_conventions import CONVENTIONS
from engine.io.privacy import scrub_absolute_paths


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TRAIN,VAL,TEST fractions such as 0.6,0.2,0.2, got {text!r}") \
            from None
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected three fractions TRAIN,VAL,TEST, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``datalist`` and ``evaluate`` to the ``fedsm`` parser."""
    p = sub.add_parser(
        "datalist", help="build a site's datalist from a folder of images and a folder of masks",
        description="Pair every image with its mask by name (the mask's name is the image's name, optionally "
                    "followed by '_', '-' or '.' and more, e.g. case7.png -> case7_mask.png), split the cases "
                    "into training/validation/testing with a seed, and write a datalist JSON. See docs/io.md.")
    p.add_argument("--images", type=Path, required=True, help="folder of images (or DICOM series sub-folders)")
    p.add_argument("--masks", type=Path, required=True, help="folder of masks")
    p.add_argument("--out", type=Path, required=True, help="datalist JSON to write (paths relative to its folder)")
    p.add_argument("--task", choices=["fundus", "prostate"], default=None,
                   help="default: fundus for photos, prostate for volumes")
    p.add_argument("--convention", choices=sorted(CONVENTIONS), default=None,
                   help="label convention of the masks (default: drishti when the masks are *_ODsegSoftmap "
                        "files, else the task's: origa for fundus, binary for prostate)")
    p.add_argument("--name", default=None, help="site name (default: the datalist's folder name)")
    p.add_argument("--split", type=_fractions, default=(0.6, 0.2, 0.2), metavar="TRAIN,VAL,TEST",
                   help="fractions of cases per section (default 0.6,0.2,0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case shuffle (default 0)")
    p.add_argument("--mask-suffix", default=None,
                   help="a mask's name is exactly the image's name plus this (e.g. _seg), before the suffix")
    p.add_argument("--case-pattern", default=None,
                   help="regular expression; its first group in an image's name is the case id (images of one "
                        "case stay in one section); default: one image = one case")
    add_allow_outside(p)
    p.set_defaults(handler=datalist_command)
    register_evaluate(sub)


def datalist_command(args: argparse.Namespace) -> int:
    """Handler of ``fedsm datalist``."""
    setup_logging(args.verbose)
    result = api.build_datalist(args.images, args.masks, args.out, task=args.task, convention=args.convention,
                                name=args.name, split=args.split, seed=args.seed, mask_suffix=args.mask_suffix,
                                case_pattern=args.case_pattern, allow_outside=args.allow_outside)
    counts = ", ".join(f"{k} {v}" for k, v in result.counts.items())
    print(f"wrote {result.path}: task {result.task}, labels {result.convention}; {counts}")
    for image in result.unmatched:
        print(f"skipped {image}: no matching mask")
    return 0


def _json_out(path: Path | None, doc: dict) -> None:
    if path is None:
        return

    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; give a file name for the JSON, e.g. {path / 'evaluation.json'}")
    # Folder names can name patients or sites: paths relative to the report's folder, else file names.
    doc = scrub_absolute_paths(doc, path.absolute().parent)
    write_text_atomic(path, json.dumps(doc, indent=2) + "\n")


def register_evaluate(sub: argparse._SubParsersAction) -> None:
    """Add ``evaluate`` to the ``fedsm`` parser."""
    p = sub.add_parser(
        "evaluate", help="Dice and HD95 of a bundle against the expert masks of site datalists",
        description="Segment every image of a datalist section with a bundle (routed, global, personalized or all) "
                    "and compare with the expert masks: per-site and per-image Dice and HD95 per structure "
                    "(MONAI metrics), and where the selector routed each image.")
    p.add_argument("--model", type=Path, required=True, help="bundle (.safetensors) from simulate or a federation")
    p.add_argument("--datalist", type=Path, nargs="+", required=True, metavar="DATALIST",
                   help="one datalist per site; its 'name' is the site's name")
    p.add_argument("--split", choices=["training", "validation", "testing"], default="testing",
                   help="datalist section to evaluate (default testing)")
    p.add_argument("--model-choice", default="routed", metavar="CHOICE",
                   help="routed (default), global, personal (each site's own model), personal:SITE, or all")
    p.add_argument("--gamma", type=float, default=None, help="routing threshold (default: the bundle's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the full report here")
    add_allow_outside(p)
    add_name_options(p)

    add_threads_option(p)
    p.set_defaults(handler=evaluate_command)


def evaluate_command(args: argparse.Namespace) -> int:
    """Handler of ``fedsm evaluate``."""
    from engine.inference.evaluate import format_evaluation

    setup_logging(args.verbose)
    check_bundle_file(args.model)  # a wrong file is said at once, not after the compute stack's import
    set_threads(args.threads)
    if args.json is not None and args.json.is_dir():
        raise ConfigError(f"{args.json}: is a folder; give a file name, e.g. {args.json / 'evaluation.json'}")
    with outside_paths_allowed(args.allow_outside):
        report = api.evaluate(args.model, args.datalist, split=args.split, model_choice=args.model_choice,
                              gamma=args.gamma, device=args.device, keep_names=args.keep_names,
                              name_map=args.name_map)
    print(format_evaluation(report))
    if args.json is not None:
        _json_out(args.json, report)
        print(f"wrote {args.json}")
    return 0
