"""``fedsm`` command line: synth, simulate, infer, plus the commands registered by sibling modules.

Commands that live in their own module (``validate-data``, ``server``/``site``/``certs``/``enroll``,
``bench``) expose ``register(subparsers)``, which adds their parsers and sets ``handler`` (a
function ``(args) -> int``) as a parser default.

Every expected failure is an :class:`engine.errors.FedSMError` and ends as one line on stderr
and exit status 2; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import engine
from engine import api, catalogue
from engine.bundle.supermodel import DEFAULT_PERSONALIZATION, PERSONALIZATION_RULES, check_bundle_file
from engine.cli.common import add_name_options, set_threads, setup_logging
from engine.cli.data_commands import add_orientation_option, apply_orientation_option
from engine.cli.progress import TerminalProgress
from engine.data.datalist import outside_paths_allowed
from engine.data.synth import FEDERATION_FILE
from engine.errors import CancelledError, ConfigError, FedSMError

log = logging.getLogger("engine.cli")

#: Modules whose ``register(subparsers)`` adds more commands; imported only to build the parser.
COMMAND_MODULES = (
    "engine.cli.data_commands", "engine.cli.federation_commands", "engine.cli.bench_command",
    "engine.cli.workflow_commands",
)


def _methods(text: str) -> tuple[str, ...]:
    return tuple(m.strip().lower() for m in text.split(",") if m.strip())


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a whole number >= 1, got {text!r}")
    return value


#: ``--threads`` help shared by every command that runs torch in its own process.
THREADS_HELP = ("torch CPU threads (default: the cores of this process's CPU set that other work is not using, "
                "or OMP_NUM_THREADS when set)")


def add_threads_option(p: argparse.ArgumentParser, more_help: str = "") -> None:
    """Add ``--threads N`` (torch's CPU threads, applied by :func:`~engine.cli.common.set_threads`) to a parser."""
    p.add_argument("--threads", type=_threads, default=None, metavar="N", help=THREADS_HELP + more_help)


def _gamma(text: str) -> float | str:
    from engine.fl.selector_gamma import parse_gamma

    try:
        return parse_gamma(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _style_gate(text: str) -> float | None:
    from engine.fl.style_gate import parse_style_gate

    try:
        return parse_style_gate(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["blackfed_client_epochs=4", ...]`` -> ``{"blackfed_client_epochs": 4}`` (numbers parsed as JSON)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE, e.g. blackfed_client_epochs=4")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsm", description="Federated super-model segmentation (FedSM).")
    parser.add_argument("--version", action="version", version=f"fedsm {engine.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write synthetic multi-site data (images, masks, datalists)")
    p.add_argument("--task", choices=["fundus", "prostate"], required=True)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("simulate", help="run methods in-process on synthetic sites and write a report")
    p.add_argument("--task", choices=["fundus", "prostate"], required=True)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", type=_methods, default=("fedavg", "fedsm"),
                   help=f"comma-separated: {','.join(catalogue.method_names())}; "
                        "dialogue methods: blackfed-v1,blackfed-v2,split-whitebox,fediod")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    add_threads_option(p, "; give 1-2 per process when running several simulations side by side")
    p.add_argument("--lam", type=float, default=None,
                   help="SoftPull lambda (default 0.7 fundus, 0.3 prostate; at least 1/K)")
    p.add_argument("--gamma", type=_gamma, default=0.6,
                   help="routing threshold (strict >), or 'auto': the federation chooses it from the sites' "
                        "validation confidence histograms so that --gamma-pass of recognised images pass")
    p.add_argument("--gamma-pass", type=float, default=0.95, metavar="FRACTION",
                   help="with --gamma auto: share of the validation images the selector recognises that must "
                        "pass gamma (default 0.95, the OOD convention's 95%% TPR)")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--selector-lr", type=float, default=None,
                   help="selector Adam lr (default 1e-3, the paper's; 1e-5 with --selector-calibration lda)")
    p.add_argument("--selector-calibration", choices=["none", "temperature", "lda"], default="none",
                   help="finish the selector after training: none (reference training alone), temperature "
                        "(temperature scaling from the sites' validation NLL sums) or lda (the older per-batch "
                        "selector with an LDA last layer; routes unseen sites to a site model, see docs)")
    p.add_argument("--selector-warmup", type=int, default=0, metavar="ROUNDS",
                   help="FedSM: selector-only rounds before training (one Adam step each; default 0)")
    p.add_argument("--selector-epochs", type=int, default=1,
                   help="FedSM reference selector: passes per round, one Adam step each (default 1, the paper's)")
    p.add_argument("--selector-bn", choices=["running", "batch", "fresh"], default="batch",
                   help="FedSM reference selector's BatchNorm during local training: each batch's statistics "
                        "as the reference's train mode (default), the running (federation) statistics, or "
                        "fresh: as batch, with the running statistics re-estimated over each pass")
    p.add_argument("--routing-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="route to a personalized model only where it beat the global model on its site's "
                        "validation data by more than the noise of its validation cases (a one-sided paired "
                        "test; default on)")
    p.add_argument("--style-gate", type=_style_gate, default=0.95, metavar="QUANTILE|off",
                   help="FedSM: send images unlike every participating site's images (a federated Gaussian "
                        "of intensity statistics) to the global model; the threshold lets this share of the "
                        "sites' validation images through (default 0.95; 'off' routes by the selector alone)")
    p.add_argument("--site-routing", choices=["auto", "selector", "style"], default="auto",
                   help="FedSM: pick each image's site with the trained selector and gamma (the paper's), with "
                        "the style gate's nearest site (images outside the gate go to the global model; gamma "
                        "unused), or auto (default): whichever of the two sends more of the sites' validation "
                        "images to their own site's model, measured in the last round")
    p.add_argument("--personalization", choices=list(PERSONALIZATION_RULES), default=DEFAULT_PERSONALIZATION,
                   help="FedSM: how each site's personalized model trains: apfl (default, chosen by measurement, "
                        "docs/results.md: a private model at each site mixed with the global one), softpull (the "
                        "paper's: pulled towards the other sites' models every round), finetune (the final "
                        "global model fine-tuned at the site), perfedavg or pfedme; every rule routes through "
                        "the same selector, style gate and routing guard")
    p.add_argument("--wire-precision", choices=["bfloat16", "float32"], default="bfloat16",
                   help="how networks and optimizer moments travel each round: bfloat16 (default: half the "
                        "bytes; values down, differences up, float32 masters at both ends) or float32")
    p.add_argument("--slices", type=int, default=None,
                   help="axial slices per synthetic prostate volume (default: the generator's)")
    p.add_argument("--holdout-site", default=None, metavar="NAME",
                   help="leave this site (e.g. site6) out of training and evaluate it as an unseen site")
    p.add_argument("--selector-size", type=int, default=32)
    p.add_argument("--selector-head", choices=["gap", "classic"], default="gap")
    p.add_argument("--selector-width", type=int, choices=[8, 16, 32, 64], default=None,
                   help="the selector's VGG-11 backbone width (default: engine.bundle.supermodel."
                        "DEFAULT_SELECTOR_WIDTH; the paper's is 64, narrower ones send a fraction of its bytes: 16 "
                        "holds 1/16 of the parameters)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", dest="options",
                   help="a dialogue method's setting, e.g. blackfed_client_epochs=4 (repeatable)")
    p.add_argument("--prox-mu", type=float, default=0.01)
    p.add_argument("--extra-rounds", type=int, default=None,
                   help="FedSM-extra selector rounds (default: rounds/2 rounded up, as the paper's 100 + 50)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine", "step"], default="constant",
                   help="U-Net learning rate over the training rounds (cosine: down to lr x --lr-min-ratio)")
    p.add_argument("--lr-min-ratio", type=float, default=0.01, help="final lr of the cosine schedule, as a share")
    p.add_argument("--loss", choices=["dice", "dicece"], default="dice", help="segmentation loss")
    p.add_argument("--no-keep-best", dest="keep_best", action="store_false",
                   help="evaluate the last round's models instead of each method's best round by validation Dice")
    p.add_argument("--data", type=Path, nargs="+", default=None, metavar="DATALIST_OR_DIR",
                   help="real sites: datalist JSON files, or folders holding them (DIR/*.json, DIR/*/datalist.json),"
                        " one datalist per site (see 'fedsm datalist'); default: synthetic sites in OUT/data")
    p.add_argument("--allow-outside", action="store_true",
                   help="let datalists name files outside their own folder")
    p.add_argument("--fediod-steps", type=int, default=100, help="FedIOD distillation steps per round")
    p.add_argument("--fediod-batch", type=int, default=8, help="FedIOD generated images per step")
    p.add_argument("--teacher-epochs", type=int, default=20, help="FedIOD teachers' epoch cap (early stopping)")
    p.add_argument("--teacher-patience", type=int, default=4, help="FedIOD teachers' early-stopping patience")
    p.add_argument("--dp-noise", type=float, default=0.0,
                   help="FedIOD sites' noise multiplier on released input gradients (0 = no DP)")
    p.add_argument("--dp-epsilon", type=float, default=None,
                   help="FedIOD sites' epsilon target for the run (instead of --dp-noise)")
    p.add_argument("--dp-clip", type=float, default=1.0, help="FedIOD sites' clipping norm of one release")
    p.add_argument("--fundus-crop", choices=["none", "auto"], default="none",
                   help="auto: crop full fundus photographs (dark corners) around the optic disc, at training and "
                        "(recorded in the bundle) at inference, so crops and full photos can share a federation")

    add_orientation_option(p)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", type=Path, required=True)

    p = sub.add_parser("infer", help="segment images or volumes with a super-model bundle")
    p.add_argument("--model", type=Path, required=True, help="super-model .safetensors bundle")
    p.add_argument("--input", type=Path, required=True,
                   help="photo, volume (NIfTI, MHA, NRRD), a DICOM series folder, or a folder of them")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gamma", type=float, default=None, help="routing threshold (default: the bundle's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--format", dest="mask_format", choices=["nifti", "png", "dicom-seg"], default=None,
                   help="mask format (default: nifti for volumes, png for photos; dicom-seg needs DICOM input)")
    p.add_argument("--model-choice", default="routed", metavar="routed|global|SITE",
                   help="routed (default: the selector picks per image), global, or a site's name (its "
                        "personalized model; also personal:SITE)")
    p.add_argument("--site", default=None,
                   help="BlackFed (split-network) bundles: whose client net to use; super models: use that "
                        "site's personalized model instead of routing")
    add_name_options(p)
    add_threads_option(p)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _simulation_data(data: list[Path] | None) -> tuple[str | None, tuple[str, ...]]:
    """``--data`` as ``(synthetic data folder, real datalists)``: one of the two, or neither (synthetic in OUT/data).

    A folder FedSM generated earlier (it holds ``federation.json``) stays a synthetic data cache;
    anything else must hold real datalists, and FedSM never writes into it.
    """
    from engine.data.datalist_builder import find_datalists

    if not data:
        return None, ()
    if len(data) == 1 and (data[0] / FEDERATION_FILE).is_file():
        return str(data[0]), ()
    return None, tuple(str(p) for p in find_datalists(data))


def _run(args: argparse.Namespace) -> int:
    handler = getattr(args, "handler", None)
    if handler is not None:
        return int(handler(args))
    if args.command == "synth":
        setup_logging(args.verbose)
        paths = api.synthesize(args.task, args.sites, args.out, image_size=args.image_size, seed=args.seed)
        for p in paths:
            print(p)
        return 0
    if args.command == "simulate":
        from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH

        apply_orientation_option(args)
        if args.selector_width is None:
            args.selector_width = DEFAULT_SELECTOR_WIDTH
        data_dir, datalists = _simulation_data(args.data)
        setup_logging(args.verbose, args.out / "simulate.log")
        set_threads(args.threads)
        progress = TerminalProgress(args.out / "events.jsonl")
        try:
            with outside_paths_allowed(args.allow_outside):
                report = api.simulate(
                    out_dir=args.out, progress=progress, task=args.task, sites=args.sites, rounds=args.rounds,
                    methods=args.methods, image_size=args.image_size, seed=args.seed, lam=args.lam,
                    gamma=args.gamma, gamma_pass=args.gamma_pass, epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr,
                    selector_lr=args.selector_lr, selector_size=args.selector_size,
                    selector_head=args.selector_head, selector_width=args.selector_width, prox_mu=args.prox_mu,
                    extra_rounds=args.extra_rounds,
                    lr_schedule=args.lr_schedule, lr_min_ratio=args.lr_min_ratio, loss=args.loss,
                    keep_best=args.keep_best,
                    fediod_steps=args.fediod_steps, fediod_batch=args.fediod_batch,
                    teacher_epochs=args.teacher_epochs, teacher_patience=args.teacher_patience,
                    dp_noise=args.dp_noise, dp_epsilon=args.dp_epsilon, dp_clip=args.dp_clip,
                    selector_calibration=args.selector_calibration, selector_warmup=args.selector_warmup,
                    selector_epochs=args.selector_epochs, selector_bn=args.selector_bn,
                    routing_guard=args.routing_guard, style_gate=args.style_gate,
                    site_routing=args.site_routing, personalization=args.personalization,
                    wire_precision=args.wire_precision, holdout_site=args.holdout_site, slices=args.slices,
                    device=args.device, data_dir=data_dir, datalists=datalists, fundus_crop=args.fundus_crop,
                    options=parse_options(args.options))
        finally:
            progress.close()
        print((args.out / "report.md").read_text(encoding="utf-8"))
        print(f"wrote {args.out / 'report.json'}, {args.out / 'report.md'}"
              + (f", {args.out / 'supermodel.safetensors'}" if "fedsm" in report["supermodel"] else ""))
        return 0
    if args.command == "infer":
        setup_logging(args.verbose)
        check_bundle_file(args.model)  # a wrong file is said at once, not after the compute stack's import
        set_threads(args.threads)
        choice = args.model_choice.strip()
        force = None if choice == "routed" else choice.removeprefix("personal:")
        summary = api.infer(args.model, args.input, args.out, gamma=args.gamma, device=args.device,
                            mask_format=args.mask_format, force_model=args.site or force,
                            keep_names=args.keep_names, name_map=args.name_map)
        # Each input as routing.json names it: its case (the hash of its content) unless --keep-names.
        for item in summary.get("inputs", []):
            models = [s["model"] for s in item.get("slices", item.get("images", []))]
            print(f"{item.get('input', item.get('case'))}: {item.get('mask')} ({len(models)} image(s); "
                  f"routed to {', '.join(sorted(set(models)))})")
        for item in summary.get("skipped", []):
            print(f"skipped {item.get('input', item.get('case'))}: {item['reason']}")
        print(f"routing written to {args.out / 'routing.json'}")
        if args.name_map is not None:
            print(f"which case is which input: {args.name_map} (keep it apart from the outputs you share)")
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedsm`` command."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CancelledError as exc:
        print(f"cancelled: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted; files written so far are complete (writes are atomic)", file=sys.stderr)
        return 130
    except FedSMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        # the file system or the network refused (a missing folder, no permission, a full disk): the
        # user's environment, not a bug; say which path and why, in one line
        print(f"error: {os_error_message(exc)}", file=sys.stderr)
        return 2


def os_error_message(exc: OSError) -> str:
    """One line for an :class:`OSError` that reached the command line: the path, the reason, what to do."""
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    reason = exc.strerror or str(exc)
    if where:
        return (f"{where}: {reason}; check that the path exists, that its parent is a folder, and that you may "
                "read or write it")
    return f"{reason}; check the paths and permissions given"


if __name__ == "__main__":
    sys.exit(main())
