"""Write the desktop app's shipped demo into ``resources/fedsm_demo`` (see docs/gui.md#demo).

Trains the demo super model with the default ``engine.demo.DemoSettings`` (3 synthetic fundus
sites, 10 FedSM rounds, seed 0; the same code path as the app's *Retrain the demo*), stores it
with float16 weights, measures its validation Dice on that file, chooses a demo photo the
federation recognises and writes ``demo.json`` last. Takes about 3 CPU minutes.

Usage::

    python benchmarks/build_demo_bundle.py [--out resources/fedsm_demo] [--work DIR]

``--work`` keeps the synthetic sites and the full-precision training run (default: a temporary
folder, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "resources" / "fedsm_demo",
                        help="folder of the shipped demo (default: resources/fedsm_demo)")
    parser.add_argument("--work", type=Path, default=None, help="keep the training data and run here")
    args = parser.parse_args(argv)
    from engine.demo import build_shipped_demo

    last = [""]

    def progress(event: dict) -> None:
        message = event.get("message") if event.get("event") == "progress" else None
        if message and message != last[0]:
            last[0] = message
            print(message, flush=True)

    start, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="fedsm-demo-build-") as tmp:
        manifest = build_shipped_demo(args.out, args.work or Path(tmp), progress)
    print(json.dumps({k: manifest[k] for k in ("bundle_sha256", "bundle_bytes", "validation_dice_worst_site",
                                               "meets_target", "study_routing")}, indent=2))
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} CPU s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
