"""The FedSM ServerApp: rounds of per-site messages over a Flower ``Grid``.

Each round the coordinator asks the method's server half what every site gets
(:meth:`~engine.fl.methods.FederatedMethod.site_instructions`), sends each site its own
message (``Grid`` with ``dst_node_id`` = that site's node, found by site name, never by
connection order), waits for replies until ``round_timeout``, decodes and validates each reply
(:func:`engine.federation.flower.records.decode_update`, then the method's
``validate_update``: keys, shapes, dtypes, NaN/Inf), and aggregates the valid ones in the
configured site order. A site that is offline, does not answer in time, answers with an error
or with a bad update is left out of that round (with the reason in ``round_end.left_out``)
and keeps its personalized model; it takes part again as soon as it answers. A round with
fewer than ``min_sites`` valid answers is repeated (same round, same seeds) up to
``round_attempts`` times. After every aggregated round the state is checkpointed atomically.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import ServerApp

from engine.errors import CancelledError, FedSMError, WeightsError
from engine.federation.checkpoint import KEEP_CHECKPOINTS, Checkpoint
from engine.federation.events import EventWriter
from engine.federation.flower import records
from engine.federation.flower.final_evaluation import ACTION, decode_evaluation, site_weights
from engine.federation.flower.grid_exchange import QUERY, TRAIN, exchange
from engine.federation.flower.run_confirmation import DECLINED
from engine.fl.methods import SiteInstructions, SiteUpdate
from engine.fl.robust import RobustSettings, UpdateScreen, aggregate_leaving_out
from engine.fl.wire_precision import DownCache, decode_up, encode_down

if TYPE_CHECKING:
    from flwr.app import Context
    from flwr.serverapp import Grid

    from engine.federation.spec import MethodSpec
    from engine.fl.methods import FederatedMethod, WeightSet

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class RoundSettings:
    """How the coordinator runs rounds (``[federation]`` in ``federation.toml``)."""

    min_sites: int = 1
    round_timeout: float = 600.0
    start_timeout: float = 600.0
    round_attempts: int = 3
    poll_interval: float = 0.2
    rejoin_wait: float = 0.0


class SiteDirectory(Protocol):
    """Which configured sites are connected now, and at which node."""

    def online(self, grid: Grid) -> dict[str, int]:
        """``{site: node_id}`` of the configured sites that are connected now."""


class RegisteredSites:
    """Sites known by their enrolled keys: each key was registered and got a stable node id."""

    def __init__(self, node_ids: Mapping[str, int]) -> None:
        self.node_ids = dict(node_ids)

    def online(self, grid: Grid) -> dict[str, int]:
        status = {n.node_id: n.status for n in grid.get_nodes()}
        return {site: node for site, node in self.node_ids.items() if status.get(node) == "online"}


class SelfNamedSites:
    """Insecure mode only: nodes have no enrolled key, so each new node is asked its site name.

    The name is what the site claims; without site authentication nothing better exists,
    which is why this mode is for loopback demonstrations only.
    """

    def __init__(self, sites: Iterable[str], poll_interval: float = 0.2, timeout: float = 30.0) -> None:
        self.sites = set(sites)
        self.names: dict[int, str] = {}
        self.poll_interval = poll_interval
        self.timeout = timeout

    def online(self, grid: Grid) -> dict[str, int]:
        nodes = [n.node_id for n in grid.get_nodes() if n.status == "online"]
        unknown = [n for n in nodes if n not in self.names]
        if unknown:
            ask = {str(n): Message(RecordDict({records.INFO: ConfigRecord({"action": "identify"})}),
                                   dst_node_id=n, message_type=QUERY, ttl=self.timeout) for n in unknown}
            replies, _ = exchange(grid, ask, self.timeout, self.poll_interval)
            for key, reply in replies.items():
                if not reply.has_error():
                    name = reply.content.config_records.get(records.INFO, {}).get("site")
                    if isinstance(name, str) and name in self.sites:
                        self.names[int(key)] = name
        latest: dict[str, int] = {}
        for node in nodes:  # a restarted site gets a new node; the newest one wins
            if node in self.names:
                latest[self.names[node]] = node
        return latest




@dataclass
class RoundResult:
    """What one round (one attempt) produced."""

    round: int
    updates: dict[str, SiteUpdate]
    left_out: dict[str, str]
    wall_s: float
    train_s: dict[str, float] = field(default_factory=dict)
    bytes_to: dict[str, int] = field(default_factory=dict)
    bytes_from: dict[str, int] = field(default_factory=dict)


class FederationRunner:
    """The coordinator's round loop.

    Parameters
    ----------
    method
        The method's server half (built from ``spec``).
    spec
        What every site is told about the run.
    settings
        Timeouts, ``min_sites`` and polling.
    directory
        Finds each configured site's node.
    events
        Progress events (``source="server"``).
    checkpoint_path
        Written after every aggregated round.
    session
        Identifies this run across coordinator restarts (sites key their private state by it).
    app_hash
        The FAB hash of this run (recorded in checkpoints).
    cancel
        Returns ``True`` when the coordinator should stop.
    address
        Where sites connect (for ``connected`` events).
    """

    def __init__(self, method: FederatedMethod, spec: MethodSpec, settings: RoundSettings, directory: SiteDirectory,
                 events: EventWriter, checkpoint_path: Path, session: str, app_hash: str,
                 cancel: Callable[[], bool] | None = None, address: str = "") -> None:
        self.method = method
        self.spec = spec
        self.spec_json = spec.to_json()
        self.settings = settings
        self.directory = directory
        self.events = events
        self.checkpoint_path = Path(checkpoint_path)
        self.session = session
        #: this start's run id, as the coordinator signed it (engine.security.run_spec); in every message
        self.run_id = ""
        self.app_hash = app_hash
        self.cancel = cancel
        self.address = address
        self.history: list[dict[str, Any]] = []
        self._online: set[str] = set()
        #: checkpoints kept beside ``checkpoint_path`` (``None``: only the newest, no round files)
        self.keep_checkpoints: int | None = KEEP_CHECKPOINTS
        #: bounds on every site's update (``[robust]``); see :mod:`engine.fl.robust`
        self.robust = RobustSettings()
        self.screen = UpdateScreen(self.robust, lambda site, message: self.events.error(message, site=site))
        #: each site's direction evidence over the run (engine.fl.robust), rebuilt from the history on resume
        self.directions = self.robust.direction_memory_for_run()
        #: sites whose operator declined this run (engine.federation.flower.run_confirmation): absent for the
        #: rest of the run, final evaluation included
        self.declined: set[str] = set()

    @property
    def sites(self) -> tuple[str, ...]:
        return self.spec.site_names

    def set_robust(self, table: Mapping[str, Any]) -> None:
        """Use the ``[robust]`` table of ``federation.toml`` (:class:`engine.fl.robust.RobustSettings`)."""
        self.robust = RobustSettings.from_dict(table)
        self.screen.settings = self.robust
        self.directions = self.robust.direction_memory_for_run()

    # --- sites -------------------------------------------------------------------------
    def _check_cancel(self) -> None:
        if self.cancel is not None and self.cancel():
            raise CancelledError("the coordinator was stopped")

    def online_sites(self, grid: Grid) -> dict[str, int]:
        """Connected sites now; emits ``connected``/``disconnected`` for changes."""
        online = self.directory.online(grid)
        for site in sorted(set(online) - self._online):
            self.events.emit("connected", site=site, coordinator=self.address, node=online[site])
        for site in sorted(self._online - set(online)):
            self.events.emit("disconnected", site=site, reason="the site's node went offline", reconnecting=True)
        self._online = set(online)
        return online

    def wait_for_rejoin(self, grid: Grid) -> None:
        """Before a round: give disconnected sites up to ``rejoin_wait`` seconds to come back."""
        if self.settings.rejoin_wait <= 0:
            return
        deadline = time.monotonic() + self.settings.rejoin_wait
        online = self.online_sites(grid)
        if len(online) < len(self.sites):
            missing = [s for s in self.sites if s not in online]
            self.events.status(f"waiting up to {self.settings.rejoin_wait:g} s for {', '.join(missing)} to reconnect")
        while len(online) < len(self.sites) and time.monotonic() < deadline:
            self._check_cancel()
            time.sleep(max(self.settings.poll_interval, 0.5))
            online = self.online_sites(grid)

    def wait_for_sites(self, grid: Grid) -> dict[str, int]:
        """Wait until every site is connected, or ``start_timeout`` passed with at least ``min_sites``."""
        deadline = time.monotonic() + self.settings.start_timeout
        announced = -1
        while True:
            self._check_cancel()
            online = self.online_sites(grid)
            if len(online) == len(self.sites):
                return online
            if len(online) != announced:
                waiting = [s for s in self.sites if s not in online]
                self.events.status(f"{len(online)} of {len(self.sites)} sites connected; waiting for "
                                   f"{', '.join(waiting)}")
                announced = len(online)
            if time.monotonic() >= deadline:
                if len(online) >= self.settings.min_sites:
                    return online
                raise FedSMError(f"only {len(online)} of {len(self.sites)} sites connected within "
                                 f"{self.settings.start_timeout:g} s (min_sites = {self.settings.min_sites}); start "
                                 "the missing sites (fedsm site) and check their logs")
            time.sleep(max(self.settings.poll_interval, 0.5))

    # --- one round ---------------------------------------------------------------------
    def run_round(self, grid: Grid, state: WeightSet, rnd: int) -> RoundResult:
        """Send round ``rnd``'s instructions, collect and validate the answers (no aggregation)."""
        start = time.monotonic()
        total = self.method.total_rounds
        online = self.online_sites(grid)
        left_out: dict[str, str] = {}
        messages: dict[str, Message] = {}
        bytes_to: dict[str, int] = {}
        packed = records.PackCache()  # parts every site gets (global, selector) are packed once
        # 16-bit on the wire, float32 masters here (engine.fl.wire_precision): a reply's differences are
        # added to what this coordinator meant to send each site
        wire, encoded = self.method.wire_parts(rnd), DownCache()
        masters: dict[str, WeightSet] = {}
        for site in self.sites:
            if site in self.declined:
                left_out[site] = "its operator declined this run"
                continue
            if site not in online:
                left_out[site] = "not connected"
                continue
            ins = self.method.site_instructions(state, rnd, site)
            masters[site] = ins.weights
            ins = SiteInstructions(ins.round, encode_down(ins.weights, wire, encoded), ins.config)
            content = records.encode_instructions(ins, rounds=total, method=self.method.name,
                                                  spec_json=self.spec_json, session=self.session, site=site,
                                                  cache=packed, run_id=self.run_id)
            bytes_to[site] = records.record_bytes(content)
            messages[site] = Message(content, dst_node_id=online[site], message_type=TRAIN, group_id=str(rnd),
                                     ttl=self.settings.round_timeout)
            self.events.emit("sent", site=site, round=rnd, rounds=total, method=self.method.name,
                             bytes=bytes_to[site], contents=records.record_contents(content))
        arrived: dict[str, SiteUpdate] = {}
        train_s: dict[str, float] = {}
        bytes_from: dict[str, int] = {}

        def on_reply(site: str, reply: Message) -> None:
            if reply.has_error():
                if DECLINED in reply.error.reason:  # refused unpulled by the site's SuperNode, for the whole run
                    self.declined.add(site)
                    left_out[site] = "its operator declined this run"
                else:
                    left_out[site] = f"the site answered with an error: {reply.error.reason}"
                self.events.error(left_out[site], site=site, round=rnd)
                return
            try:
                update = records.decode_update(reply.content, site, rnd)
                update = SiteUpdate(decode_up(update.weights, masters[site], wire, f"reply from {site}"),
                                    update.num_samples, update.metrics)
                self.method.validate_update(state, site, update)
                update = self.screen.screen(self.method, state, site, update)  # engine.fl.robust bounds
            except (FedSMError, WeightsError) as exc:
                left_out[site] = f"update rejected: {exc}"
                log.warning("round %d: update from %s rejected: %s", rnd, site, exc)
                self.events.error(left_out[site], site=site, round=rnd)
                return
            except Exception as exc:  # whatever a site sends, the coordinator goes on
                left_out[site] = f"update rejected: it does not decode ({type(exc).__name__}: {exc})"
                log.warning("round %d: update from %s does not decode: %r", rnd, site, exc)
                self.events.error(left_out[site], site=site, round=rnd)
                return
            bytes_from[site] = records.record_bytes(reply.content)
            train_s[site] = float(update.metrics.pop("train_s", float("nan")))
            arrived[site] = update
            self.events.emit("received", site=site, round=rnd, rounds=total, method=self.method.name,
                             bytes=bytes_from[site], contents=records.record_contents(reply.content),
                             num_examples=update.num_samples, metrics=update.metrics)

        _, missing = exchange(grid, messages, self.settings.round_timeout, self.settings.poll_interval,
                              self._check_cancel_flag, on_reply)
        left_out.update(missing)
        for site, reason in missing.items():
            self.events.error(f"left out of round {rnd}: {reason}", site=site, round=rnd)
        # configured order: aggregation sums in the same order as the simulation
        updates = {site: arrived[site] for site in self.sites if site in arrived}
        return RoundResult(rnd, updates, left_out, time.monotonic() - start, train_s, bytes_to, bytes_from)

    def _check_cancel_flag(self) -> bool:
        return bool(self.cancel is not None and self.cancel())

    # --- the run -----------------------------------------------------------------------
    def run(self, grid: Grid, resume: Checkpoint | None = None) -> WeightSet:
        """Run the remaining rounds; return the final server state."""
        total = self.method.total_rounds
        if resume is not None:
            state, first = resume.state, resume.round + 1
            self.history = list(resume.history)
            # the direction evidence of the rounds already run (engine.fl.robust.DirectionMemory)
            self.directions = self.robust.direction_memory_for_run(self.history)
            self.events.status(f"resuming after round {resume.round} of {total}")
        else:
            state, first = self.method.initial_state(), 1
        if first > total:
            return state  # a finished run: nothing left to do
        self.wait_for_sites(grid)
        with CheckpointWriter(self.events, keep=self.keep_checkpoints) as writer:
            for rnd in range(first, total + 1):
                state = self._round(grid, state, rnd, writer)
        return state

    def _round(self, grid: Grid, state: WeightSet, rnd: int, writer: CheckpointWriter) -> WeightSet:
        """Run round ``rnd`` (with repeats while fewer than ``min_sites`` answer) and aggregate it."""
        total = self.method.total_rounds
        started = time.monotonic()
        self.events.emit("round_start", round=rnd, rounds=total, method=self.method.name)
        result = None
        aggregated = None
        for attempt in range(1, self.settings.round_attempts + 1):
            self._check_cancel()
            self.wait_for_rejoin(grid)
            result = self.run_round(grid, state, rnd)
            aggregated = None
            if len(result.updates) >= self.settings.min_sites:
                # an update the method cannot aggregate is left out, never a crash (engine.fl.robust)
                aggregated, refused = aggregate_leaving_out(
                    self.method, state, rnd, result.updates, self.robust,
                    lambda site, message: self.events.error(message, site=site, round=rnd, clipped=True),
                    self.directions)
                for site, reason in refused.items():
                    result.updates.pop(site, None)
                    result.left_out[site] = reason
                    self.events.error(reason, site=site, round=rnd)
                if aggregated is not None and len(result.updates) >= self.settings.min_sites:
                    break
            self.events.error(f"round {rnd}: {len(result.updates)} valid answers, fewer than min_sites = "
                              f"{self.settings.min_sites} (attempt {attempt} of {self.settings.round_attempts})",
                              round=rnd, left_out=result.left_out)
            if attempt < self.settings.round_attempts:
                self.wait_for_sites(grid)
        assert result is not None
        if aggregated is None or len(result.updates) < self.settings.min_sites:
            raise FedSMError(f"round {rnd}: fewer than min_sites = {self.settings.min_sites} sites answered in "
                             f"{self.settings.round_attempts} attempts ({result.left_out}); the checkpoint of "
                             f"round {rnd - 1} is kept: fix the sites, then run 'fedsm server --resume'")
        state = aggregated
        wall_s = time.monotonic() - started
        record = {"round": rnd, "answered": sorted(result.updates), "left_out": result.left_out,
                  "wall_s": round(wall_s, 3), "train_s": result.train_s,
                  "bytes_to_sites": sum(result.bytes_to.values()),
                  "bytes_from_sites": sum(result.bytes_from.values())}
        # kept in the checkpoint: a resumed run judges on the same evidence
        record.update(self.directions.round_record(rnd))
        self.history.append(record)
        writer.submit(Checkpoint(rnd, state, self.spec_json, self.session, self.app_hash, list(self.history)),
                      self.checkpoint_path)
        self.events.emit("round_end", round=rnd, rounds=total, method=self.method.name,
                         wall_s=round(wall_s, 3), answered=record["answered"], left_out=result.left_out,
                         train_s=result.train_s,
                         **{key: value for key, value in record.items() if key.startswith("direction")})
        return state

    def announce_finished(self, grid: Grid, timeout: float = 10.0) -> None:
        """Tell connected sites that the run is over (they emit ``finished``); answers are optional."""
        total = self.method.total_rounds
        online = self.online_sites(grid)
        messages = {site: Message(RecordDict({records.INFO: ConfigRecord(
            {"action": "finished", "rounds": total, "session": self.session})}),
            dst_node_id=node, message_type=QUERY, ttl=timeout) for site, node in online.items()}
        if hasattr(grid, "pull_timeout"):
            grid.pull_timeout = timeout  # type: ignore[attr-defined]
        exchange(grid, messages, timeout, self.settings.poll_interval)
        self.events.emit("finished", rounds=total)


class CheckpointWriter:
    """Write checkpoints in a background thread, in order, so the next round starts at once.

    A checkpoint is complete on disk (atomic rename) before its ``checkpoint`` event; leaving
    the ``with`` block waits for the last one. Should the coordinator die before a write ends,
    the previous checkpoint stands and ``--resume`` repeats one more round (rounds are
    deterministic, so the result is the same).
    """

    def __init__(self, events: EventWriter, keep: int | None = None) -> None:
        self.events = events
        self.keep = keep
        self._pool: Any = None
        self._pending: list[Any] = []

    def __enter__(self) -> CheckpointWriter:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        return self

    def submit(self, checkpoint: Checkpoint, path: Path) -> None:
        def write() -> None:
            saved = checkpoint.save(path, keep=self.keep)
            self.events.emit("checkpoint", round=checkpoint.round, path=str(saved))

        self._pending = [f for f in self._pending if not f.done()] + [self._pool.submit(write)]
        for future in self._pending:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
        for future in self._pending:
            if future.exception() is not None and exc[0] is None:
                raise future.exception()


def evaluate_request(runner: FederationRunner, state: WeightSet, site: str) -> RecordDict:
    """The content of the ``evaluate`` query for ``site``."""
    total = runner.method.total_rounds
    content = records.encode_instructions(SiteInstructions(total, site_weights(state, site), {"phase": ACTION}),
                                          rounds=total, method=runner.method.name, spec_json=runner.spec_json,
                                          session=runner.session, site=site, run_id=runner.run_id)
    content.config_records[records.INFO]["action"] = ACTION
    return content


def evaluate_final(runner: FederationRunner, grid: Grid, state: WeightSet) -> dict[str, dict[str, dict[str, float]]]:
    """Ask every connected site for the final models' Dice; return ``{site: {split: {model: Dice}}}``.

    Sites that are offline, do not answer within ``round_timeout`` or answer badly are left out
    (an ``error`` event says why); the run's result does not depend on them.
    """
    if "global" not in state or runner.method.name == "local":
        return {}  # dialogue methods and local training: no shared final model to send
    online = runner.online_sites(grid)
    messages = {site: Message(evaluate_request(runner, state, site), dst_node_id=node, message_type=QUERY,
                              ttl=runner.settings.round_timeout)
                for site, node in online.items() if site in runner.sites and site not in runner.declined}
    if not messages:
        return {}
    runner.events.status(f"final evaluation at {len(messages)} site(s): validation and testing Dice of the final "
                         "models")
    results: dict[str, dict[str, dict[str, float]]] = {}

    def on_reply(site: str, reply: Message) -> None:
        if reply.has_error():
            runner.events.error(f"final evaluation failed at the site: {reply.error.reason}", site=site)
            return
        try:
            results[site] = decode_evaluation(reply.content, site)
        except WeightsError as exc:
            runner.events.error(str(exc), site=site)

    _, missing = exchange(grid, messages, runner.settings.round_timeout, runner.settings.poll_interval,
                          runner._check_cancel_flag, on_reply)
    for site, reason in missing.items():
        runner.events.error(f"no final evaluation: {reason}", site=site)
    return {site: results[site] for site in runner.sites if site in results}


def build_server_app(runner: FederationRunner, resume: Checkpoint | None, result: dict[str, Any]) -> ServerApp:
    """A Flower ``ServerApp`` whose main function runs ``runner`` and stores the final state in ``result``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result["state"] = runner.run(grid, resume)
        # each site's validation and testing Dice of the final models (final_evaluation.py)
        result["site_dice"] = evaluate_final(runner, grid, result["state"])
        runner.announce_finished(grid)

    return app
