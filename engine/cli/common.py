"""What every ``fedsm`` command sets up the same way: logging and torch's CPU threads."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def set_threads(threads: int | None) -> int:
    """torch's CPU threads for a command: ``threads`` if given (kept while the command runs, also when
    inference loads a model), else ``OMP_NUM_THREADS`` or the free cores (:mod:`engine.threads`)."""
    from engine.threads import use_threads

    return use_threads(threads)


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
