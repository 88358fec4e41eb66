"""What every ``fedsm`` command sets up the same way: logging, torch's CPU threads, the naming of outputs."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.startup import collector_paused, import_compute_stack
from engine.threads import use_threads


def set_threads(threads: int | None, load_stack: bool = True) -> int:
    """torch's CPU threads for a command: ``threads`` if given (kept while the command runs, also when
    inference loads a model), else ``OMP_NUM_THREADS`` or the free cores (:mod:`engine.threads`).

    Every command that trains or infers calls this first; with ``load_stack`` it also imports the
    rest of the compute stack, with the garbage collector paused (:mod:`engine.startup`). ``fedsm
    site`` passes ``False``: it loads the stack only once its checks have passed.
    """
    with collector_paused():
        count = use_threads(threads)
        if load_stack:
            import_compute_stack()
    return count


def setup_logging(verbose: bool, log_file: Path | None = None) -> None:
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.DEBUG if verbose else logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root.addHandler(console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def add_name_options(p: argparse.ArgumentParser) -> None:
    """``--keep-names`` and ``--name-map`` for commands whose outputs would otherwise name their inputs."""
    p.add_argument("--keep-names", action="store_true",
                   help="name outputs after the input files (e.g. DOE^JOHN_mask.png) and list the inputs' paths; "
                        "default: each input is a case named by the hash of its content (case-3f2a9c01d4), since "
                        "file names often name patients")
    p.add_argument("--name-map", type=Path, default=None, metavar="FILE",
                   help="also write which case is which input to FILE (JSON); keep it apart from the outputs")
