"""``fedsm bench``: the paper's comparisons on synthetic multi-site data, plus speed/traffic/memory.

    fedsm bench --preset tiny|cpu-small|cpu-converged|paper [--out DIR] [--fresh] [--device auto|cpu|cuda]
                [--threads N] [--docs [--force-docs]]

Every finished job is cached under ``OUT/results``; a rerun resumes (``--fresh`` starts over).
``OUT/report/results.md`` is always written; ``--docs`` also regenerates the repository's
``docs/results.md`` and ``docs/img/results/*.png``, which only the presets of
:data:`DOCS_PRESETS` may do unless ``--force-docs`` is given (a smoke-test preset would replace
the published numbers).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from engine import api
from engine.bench.presets import get_preset
from engine.cli.common import set_threads, setup_logging
from engine.cli.main import add_threads_option
from engine.cli.progress import TerminalProgress
from engine.errors import ConfigError

#: The repository's documentation folder (``--docs`` writes there).
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"

#: Presets whose results may replace ``docs/results.md`` without ``--force-docs``.
DOCS_PRESETS = ("cpu-small", "cpu-converged", "paper")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``fedsm bench`` to the ``fedsm`` parser."""
    p = sub.add_parser("bench", help="benchmark the methods on synthetic multi-site data and write results.md")
    p.add_argument("--preset", choices=["tiny", "cpu-small", "cpu-converged", "paper", "blackfed", "fediod-cpu"],
                   default="cpu-small",
                   help="tiny: CI smoke test (seconds); cpu-small: the full study on a CPU, few rounds (~20 min); "
                        "cpu-converged: trained to a plateau, lr tuned on validation (~3 h on 2 cores); "
                        "paper: 256 px, 150 rounds, meant for a GPU; blackfed: BlackFed's Tables 2-3 alone; "
                        "fediod-cpu: FedIOD's tables alone")
    p.add_argument("--tasks", default=None, help="reduced run: only these tasks (comma-separated)")
    p.add_argument("--seeds", default=None, help="reduced run: only these main-comparison seeds (comma-separated)")
    p.add_argument("--methods", default=None, help="reduced run: only these main methods (comma-separated)")
    p.add_argument("--main-only", action="store_true",
                   help="reduced run: only the main comparison (no speed figures, lr tuning or analyses)")
    p.add_argument("--no-analyses", action="store_true",
                   help="reduced run: the main comparison with its lr tuning and speed figures, without the lam "
                        "sweep, unseen-site, personalization, BlackFed and FedIOD analyses")
    p.add_argument("--rules-only", action="store_true",
                   help="reduced run: the main comparison with its lr tuning and FedSM with every personalization "
                        "rule, without the speed figures, lam sweep, unseen-site, BlackFed and FedIOD analyses")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench-PRESET)")
    p.add_argument("--fresh", action="store_true", help="ignore cached job results and run everything again")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")

    add_threads_option(p, "; recorded in the report")
    p.add_argument("--docs", action="store_true",
                   help="also write docs/results.md and docs/img/results/*.png of this repository "
                        f"(presets {', '.join(DOCS_PRESETS)} only, unless --force-docs)")
    p.add_argument("--force-docs", action="store_true",
                   help="let --docs overwrite docs/results.md with another preset's results")
    p.set_defaults(handler=run_bench)


def _reduction(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.tasks:
        out["tasks"] = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if args.seeds:
        try:
            out["seeds"] = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        except ValueError:
            raise ConfigError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if args.methods:
        out["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if args.main_only:
        out["main_only"] = True
    if args.no_analyses:
        out["no_analyses"] = True
    if args.rules_only:
        out["rules_only"] = True
    return out


def run_bench(args: argparse.Namespace) -> int:
    """Handler of ``fedsm bench``."""
    out = args.out or Path("runs") / f"bench-{args.preset}"

    own_file = get_preset(args.preset).docs_file != "results.md"  # e.g. fediod-cpu -> docs/results-fediod.md
    if args.docs and args.preset not in DOCS_PRESETS and not own_file and not args.force_docs:
        raise ConfigError(
            f"--docs would replace {DOCS_DIR / 'results.md'} (the published {' / '.join(DOCS_PRESETS)} results) "
            f"with preset {args.preset!r}; its report is written to {out / 'report' / 'results.md'} anyway "
            "(choose the folder with --out DIR). Add --force-docs to overwrite the docs regardless.")
    setup_logging(args.verbose, out / "bench.log")
    threads = set_threads(args.threads)
    progress = TerminalProgress(out / "events.jsonl")
    command = "fedsm " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None
    try:
        summary = api.benchmark(args.preset, out, fresh=args.fresh, device=args.device, threads=threads,
                                docs_dir=DOCS_DIR if args.docs else None, progress=progress,
                                command=command or f"fedsm bench --preset {args.preset}", **_reduction(args))
    finally:
        progress.close()
    print(f"{len(summary['ran'])} job(s) run, {len(summary['cached'])} reused from the cache, "
          f"{len(summary['failed'])} failed, in {summary['wall_s']:.0f} s")
    for label, message in summary["failed"].items():
        print(f"  failed: {label}: {message}")
    print(f"report: {summary['report']}" + (f"; docs: {summary['docs']}" if "docs" in summary else ""))
    return 1 if summary["failed"] else 0
