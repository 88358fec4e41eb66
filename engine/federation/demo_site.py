"""A simulated site for the desktop app's federation panel and its tests.

``python -m engine.federation.demo_site --workdir W --site site1 --rounds 3 --image-size 32``
runs a real FedSM federation of ``K`` small synthetic sites in this one process (the in-process
transport, :func:`engine.federation.inprocess.run_rounds`, with the same method code the network
federation runs) and prints, one JSON object per line on stdout, the events the named site would
print as ``fedsm site --json``::

    status, connected, round_start, received, batch..., metrics, sent, round_end, ..., finished

``received`` and ``sent`` carry the raw tensor bytes of the real payloads and what they held
(tensor groups and counts, the sample count, metric names). ``metrics`` reports the round's
mean training losses and validation Dice of three models on the site's validation split: the
global and personalized models the site received this round, and ``local``, the site's own
personalized model after this round's local training (before SoftPull). Dice is shown to the
operator only; it is not part of what the site sends.

The command line (what the app's Join runs) starts with :data:`DEMO_SELECTOR_WARMUP` rounds
that train the model selector alone (FedSM's ``selector_warmup``): the paper's selector takes one
Adam step per round, and with three rounds it has learned nothing but the sites' sizes (4, 6
and 10 training images), so the smallest site's own selector loss climbed above ln 3 round
after round while the U-Nets' losses fell. After the warm-up every site's selector loss is
below ln 3 when the U-Nets start. The warm-up rounds send the selector and its Adam moments only.

SIGTERM or SIGINT stop the run at once (the demo keeps no state worth finishing: its data files
are written atomically): the site reports ``disconnected`` and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from engine.errors import CancelledError, FedSMError
from engine.federation.events import EventWriter
from engine.tasks import get_task

log = logging.getLogger(__name__)

#: Selector-only rounds before the demo's training rounds (the command line's ``--selector-warmup``).
#: Measured on the app's demo (3 sites, seed 0, 32 px, batch 2, 3 training rounds, site1 watched,
#: the default width-16 selector at its 3e-3 rate): site1's selector loss (mean batch cross-entropy
#: at the received selector) is 1.09 in round 1 (untrained), 1.42-1.97 in rounds 2-4 (the first
#: steps learn the sites' sizes, and site1 is the smallest), 1.14 in round 12 and 1.02 in round 14
#: (ln 3 = 1.10); in the training rounds 15-17 it is 0.99, 0.94 and 0.87 while the U-Nets' losses
#: fall (0.94, 0.91, 0.89). The whole run took 37 s on this 2-core machine with another job running.
#: (The paper's width 64 at 1e-3 passed ln 3 by round 10; 12 warm-up rounds were enough for it.)
DEMO_SELECTOR_WARMUP = 14


def stdout_events(site: str, stream: IO[str] | None = None) -> Callable[[dict[str, Any]], None]:
    """``emit(event)`` writing site events as JSON lines (the format of ``fedsm site --json``)."""
    writer = EventWriter("site", site, stream=stream or sys.stdout)

    def emit(event: dict[str, Any]) -> None:
        fields = dict(event)
        writer.emit(fields.pop("event"), **fields)

    return emit


def _tensor_counts(weights: dict[str, Any]) -> dict[str, int]:
    return {group: len(tensors) for group, tensors in weights.items()}


class ObservedSite:
    """Wraps a :class:`~engine.fl.methods.FederatedMethod` to report one site's traffic and metrics.

    Every call is delegated unchanged; for the watched site the wrapper also emits ``received``
    (from the instructions' tensors), forwards its ``batch`` events, and after local training
    emits ``metrics`` and ``sent`` (from the update's tensors).
    """

    def __init__(self, method: Any, site: Any, emit: Callable[[dict[str, Any]], None],
                 evaluate: Callable[[dict[str, Any], Any], dict[str, float]]) -> None:
        self._method = method
        self._site = site
        self._emit = emit
        self._evaluate = evaluate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)

    def site_instructions(self, state: Any, rnd: int, site: str) -> Any:
        from engine.federation.inprocess import weightset_bytes
        from engine.fl.wire_precision import encode_down

        instructions = self._method.site_instructions(state, rnd, site)
        if site == self._site.name:
            sent = encode_down(instructions.weights, self._method.wire_parts(rnd))
            self._emit({"event": "received", "round": rnd, "rounds": self._method.total_rounds,
                        "method": self._method.name, "bytes": weightset_bytes(sent),
                        "contents": _tensor_counts(instructions.weights)})
        return instructions

    def train_at_site(self, instructions: Any, site: Any, progress: Any = None, cancel: Any = None) -> Any:
        from engine.federation.inprocess import weightset_bytes
        from engine.fl.wire_precision import encode_up

        if site.name != self._site.name:
            return self._method.train_at_site(instructions, site, None, cancel)

        def relay(event: dict[str, Any]) -> None:
            if event.get("event") == "batch":
                self._emit({"event": "batch", "round": event["round"], "batch": event["batch"],
                            "batches": event["batches"], "loss": event.get("loss", {}),
                            "method": event.get("method", self._method.name)})

        update = self._method.train_at_site(instructions, site, relay, cancel)
        rnd = instructions.round
        losses = {k.removeprefix("loss_"): float(v) for k, v in update.metrics.items() if k.startswith("loss")}
        dice = self._evaluate(instructions.weights, update)
        if losses or dice:
            self._emit({"event": "metrics", "round": rnd, "loss": losses, "dice": dice})
        reply = encode_up(update.weights, instructions.weights, self._method.wire_parts(rnd))
        self._emit({"event": "sent", "round": rnd, "bytes": weightset_bytes(reply),
                    "contents": {"tensors": _tensor_counts(update.weights), "num_examples": update.num_samples,
                                 "metrics": sorted(update.metrics)}})
        return update


def _validation_dice(task: Any, validation: Any, method: Any,
                     runtime: Any) -> Callable[[dict[str, Any], Any], dict[str, float]]:
    """Dice of the received global/personalized and the locally trained model on ``validation``.

    The personalized model is :meth:`~engine.fl.methods.FedSM.personal_model_now`'s, as a network
    site scores it.
    """
    from engine.fl.evaluation import dice_per_case, segment_with

    def dice_of(weights: Any) -> float:
        masks = segment_with(task, weights, validation.images, device="cpu")
        return round(float(dice_per_case(masks, validation.masks, validation.case_ids).mean()), 4)

    def evaluate(received: dict[str, Any], update: Any) -> dict[str, float]:
        if not len(validation.images) or "global" not in received:
            return {}
        out = {"global": dice_of(received["global"])}
        personal = method.personal_model_now(received, runtime.state)
        if personal is not None:
            out["personalized"] = dice_of(personal)
        local = update.weights.get("personal", update.weights.get("global"))
        if local is not None:
            out["local"] = dice_of(local)
        return out

    return evaluate


def run_demo_site(workdir: Path, site: str = "site1", rounds: int = 3, image_size: int = 32, sites: int = 3,
                  task: str = "fundus", epochs: int = 1, seed: int = 0, batch_size: int = 2,
                  emit: Callable[[dict[str, Any]], None] | None = None,
                  cancel: Callable[[], bool] | None = None, selector_warmup: int = 0) -> int:
    """Run the simulated federation and report ``site``'s events; return the process exit code.

    ``selector_warmup`` rounds train the selector alone before the ``rounds`` training rounds (the
    command line, which the app runs, uses :data:`DEMO_SELECTOR_WARMUP`).
    """
    from engine.bundle.supermodel import DEFAULT_PERSONALIZATION
    from engine.data.site_data import load_site
    from engine.data.synth import existing_federation, generate_federation
    from engine.federation.inprocess import run_rounds
    from engine.fl.local_training import LocalTrainingConfig
    from engine.fl.methods import FedSM, SiteRuntime

    emit = emit or stdout_events(site)
    spec = get_task(task)
    data_dir = Path(workdir) / "data"
    emit({"event": "status", "message": f"preparing {sites} synthetic {task} sites in {data_dir}"})
    datalists = existing_federation(data_dir, task, sites, image_size, seed)
    if datalists is None:
        datalists = generate_federation(task, sites, data_dir, image_size=image_size, seed=seed)
    loaded = [load_site(p, spec, image_size) for p in datalists]
    names = [s.name for s in loaded]
    if site not in names:
        raise FedSMError(f"site {site!r} is not in the demo federation; choose one of {', '.join(names)}")
    runtimes = [SiteRuntime(s.name, i, s.train, validation=s.validation) for i, s in enumerate(loaded)]
    watched = runtimes[names.index(site)]
    training = LocalTrainingConfig(epochs=epochs, batch_size=batch_size, device="cpu")
    # the product's default personalization rule (fedsm simulate's and a network run's)
    method = FedSM(spec, names, training, seed, rounds, lam=max(0.7, 1.0 / len(names)), gamma=0.6,
                   selector_warmup=selector_warmup, personalization=DEFAULT_PERSONALIZATION)
    observed = ObservedSite(method, watched, emit,
                            _validation_dice(spec, loaded[names.index(site)].validation, method, watched))
    emit({"event": "connected", "coordinator": f"in-process demo federation ({len(names)} sites)"})
    if selector_warmup:
        first = selector_warmup + 1
        emit({"event": "status", "message": f"rounds 1-{selector_warmup} train the model selector alone (one step "
                                            f"each: it must tell the sites apart before it routes); rounds "
                                            f"{first}-{selector_warmup + rounds} train all three networks; round "
                                            f"{method.total_rounds} validates the final models"})

    def relay(event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "round_start":
            emit({"event": "round_start", "round": event["round"], "rounds": event["rounds"],
                  "method": event["method"]})
        elif kind == "round_end":
            emit({"event": "round_end", "round": event["round"], "rounds": event["rounds"],
                  "wall_s": event["wall_s"]})
        elif kind == "error" and event.get("site") in (None, site):
            emit({"event": "error", "message": event.get("message", ""), "round": event.get("round")})

    try:
        run_rounds(observed, runtimes, method.total_rounds, progress=relay, cancel=cancel)  # type: ignore[arg-type]
    except CancelledError:
        emit({"event": "disconnected", "reason": "stopped by the operator", "reconnecting": False})
        return 0
    emit({"event": "finished", "rounds": method.total_rounds})
    return 0


class _Stopped(BaseException):
    """Raised by the signal handler in the main thread, wherever it is (not an ``Exception``)."""


def demo_site_command(workdir: Path, site: str = "site1", rounds: int = 3, image_size: int = 32) -> list[str]:
    """The command line that runs this module as a site process (for QProcess; with the selector warm-up)."""
    return [sys.executable, "-m", "engine.federation.demo_site", "--workdir", str(Path(workdir).absolute()),
            "--site", site, "--rounds", str(int(rounds)), "--image-size", str(int(image_size))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.federation.demo_site", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="folder for the synthetic data (reused)")
    parser.add_argument("--site", default="site1", help="the site whose events are printed (default site1)")
    parser.add_argument("--rounds", type=int, default=3, help="FedSM training rounds (one calibration round follows)")
    parser.add_argument("--selector-warmup", type=int, default=DEMO_SELECTOR_WARMUP, metavar="ROUNDS",
                        help=f"selector-only rounds before training (default {DEMO_SELECTOR_WARMUP}: the selector "
                             "takes one step per round and needs them to tell the sites apart)")
    parser.add_argument("--image-size", type=int, default=32, help="image side in pixels (multiple of 16)")
    parser.add_argument("--sites", type=int, default=3, help="sites in the federation (2..12)")
    parser.add_argument("--task", default="fundus", choices=("fundus", "prostate"))
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument("--batch-size", type=int, default=2, help="local batch size (small: a visible progress bar)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stays out of the way)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def stop_now(signum: int, frame: Any) -> None:
        raise _Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
    emit = stdout_events(args.site)
    try:
        import torch

        torch.set_num_threads(max(1, args.threads))
        return run_demo_site(args.workdir, args.site, args.rounds, args.image_size, args.sites, args.task,
                             args.epochs, args.seed, args.batch_size, emit, selector_warmup=args.selector_warmup)
    except _Stopped as stop:
        emit({"event": "disconnected", "reason": f"stopped by the operator ({stop})", "reconnecting": False})
        # Leave at once: a normal interpreter exit spends seconds tearing torch down, and this
        # process holds nothing that needs closing (stdout is flushed, data files are atomic).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except FedSMError as exc:
        emit({"event": "error", "message": str(exc)})
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
