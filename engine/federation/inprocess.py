"""In-process federation: every site's half runs in this process, one after the other.

This is the simulation transport. It calls exactly the methods' server and site halves that
the network transport calls (:func:`run_rounds` for one-exchange methods,
:func:`run_exchange_rounds` for dialogue methods, :mod:`engine.fl.exchange`), counts the
bytes each site would send and receive, and treats a site that raises as a failure of that
round (left out of aggregation, back next round), the way Flower hands failures to a strategy
as data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import CancelledError, FedSMError, WeightsError
from engine.fl.exchange import ExchangeMethod, Failure, Reply, tensor_bytes
from engine.fl.methods import FederatedMethod, SiteInstructions, SiteRuntime, SiteUpdate, WeightSet
from engine.fl.robust import RobustSettings, UpdateScreen, aggregate_leaving_out
from engine.fl.weights import payload_bytes
from engine.fl.wire_precision import DownCache, decode_down, decode_up, encode_down, encode_up

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]


@dataclass
class RoundRecord:
    """What happened in one round, per site."""

    round: int
    answered: list[str]
    failed: dict[str, str]
    bytes_to_site: dict[str, int]
    bytes_from_site: dict[str, int]
    metrics: dict[str, dict[str, float]]
    wall_s: float
    site_train_s: dict[str, float] = field(default_factory=dict)
    #: ``{part: {site: cosine}}``: each site's change against the others' median (engine.fl.robust), when judged
    direction: dict[str, dict[str, float]] = field(default_factory=dict)
    #: ``{part: size}``: the sites' median change, and ``{part: bool}``: whether the round counted as evidence
    direction_size: dict[str, float] = field(default_factory=dict)
    direction_judged: dict[str, bool] = field(default_factory=dict)


def weightset_bytes(weights: WeightSet) -> int:
    """Raw tensor bytes of a payload (what goes over the wire, before any framing)."""
    return sum(payload_bytes(w) for w in weights.values())


def run_rounds(
    method: FederatedMethod,
    sites: list[SiteRuntime],
    rounds: int,
    *,
    state: WeightSet | None = None,
    first_round: int = 1,
    min_sites: int = 1,
    progress: ProgressFn | None = None,
    cancel: Callable[[], bool] | None = None,
    robust: RobustSettings | None = None,
) -> tuple[WeightSet, list[RoundRecord]]:
    """Run rounds ``first_round..rounds`` of ``method`` over ``sites`` in this process.

    Parameters
    ----------
    state
        Server state to continue from (``None`` = the method's initial state).
    min_sites
        A round whose answering sites are fewer than this leaves the state unchanged and
        is reported as failed.
    robust
        The coordinator's ``[robust]`` bounds (:mod:`engine.fl.robust`): each update is screened
        and the round aggregated as a network coordinator does (``None``: the method's own
        aggregation alone).

    Returns
    -------
    state, records
        Final server state and one :class:`RoundRecord` per round.
    """
    state = method.initial_state() if state is None else state
    records: list[RoundRecord] = []
    screen = None if robust is None else UpdateScreen(robust)
    directions = None if robust is None else robust.direction_memory_for_run()  # evidence over the run
    for rnd in range(first_round, rounds + 1):
        if cancel is not None and cancel():
            raise CancelledError(f"{method.name}: cancelled before round {rnd}")
        start = time.perf_counter()
        if progress:
            progress({"event": "round_start", "method": method.name, "round": rnd, "rounds": rounds})
        updates: dict[str, SiteUpdate] = {}
        failed: dict[str, str] = {}
        to_site: dict[str, int] = {}
        from_site: dict[str, int] = {}
        train_s: dict[str, float] = {}
        wire, encoded = method.wire_parts(rnd), DownCache()
        for site in sites:
            instructions = method.site_instructions(state, rnd, site.name)
            # what a network site receives and sends back (engine.fl.wire_precision), bit for bit
            sent = encode_down(instructions.weights, wire, encoded)
            to_site[site.name] = weightset_bytes(sent)
            received = SiteInstructions(rnd, decode_down(sent, wire), instructions.config)
            t0 = time.perf_counter()
            try:
                update = method.train_at_site(received, site, progress, cancel)
                reply = encode_up(update.weights, received.weights, wire)
                reply_bytes = weightset_bytes(reply)
                update = SiteUpdate(decode_up(reply, instructions.weights, wire, f"update from {site.name}"),
                                    update.num_samples, update.metrics)
                method.validate_update(state, site.name, update)
                if screen is not None:
                    update = screen.screen(method, state, site.name, update)
            except CancelledError:
                raise
            except (FedSMError, WeightsError, RuntimeError) as exc:
                log.warning("round %d: update from %s rejected: %s", rnd, site.name, exc)
                failed[site.name] = str(exc)
                if progress:
                    progress({"event": "error", "method": method.name, "round": rnd, "site": site.name,
                              "message": str(exc)})
                continue
            train_s[site.name] = time.perf_counter() - t0
            from_site[site.name] = reply_bytes
            updates[site.name] = update
        if len(updates) >= max(min_sites, 1):
            if robust is None:
                state = method.aggregate(state, rnd, updates)
            else:
                def clipped(name: str, message: str, rnd: int = rnd) -> None:
                    if progress:
                        progress({"event": "error", "method": method.name, "round": rnd, "site": name,
                                  "message": message, "clipped": True})  # kept in the round, scaled down

                aggregated, refused = aggregate_leaving_out(method, state, rnd, updates, robust, clipped, directions)
                for name, reason in refused.items():
                    updates.pop(name)
                    failed[name] = reason
                state = aggregated if aggregated is not None else state
        else:
            log.warning("round %d: only %d of %d sites answered (min_sites=%d); state unchanged",
                        rnd, len(updates), len(sites), min_sites)
        record = RoundRecord(rnd, sorted(updates), failed, to_site, from_site,
                             {s: u.metrics for s, u in updates.items()}, time.perf_counter() - start, train_s,
                             **({} if directions is None else directions.round_record(rnd)))
        records.append(record)
        if progress:
            progress({"event": "round_end", "method": method.name, "round": rnd, "rounds": rounds,
                      "answered": record.answered, "bytes_to_sites": sum(to_site.values()),
                      "bytes_from_sites": sum(from_site.values()), "wall_s": round(record.wall_s, 3),
                      "metrics": record.metrics})
    return state, records


@dataclass
class ExchangeRecord:
    """One exchange of a dialogue as the transport saw it (for ledgers and tests)."""

    round: int
    site: str
    action: str
    request_tensors: dict[str, tuple[int, ...]]
    reply_tensors: dict[str, tuple[int, ...]]
    bytes_to_site: int
    bytes_from_site: int
    failed: str | None = None
    #: the request's JSON settings (e.g. FedIOD's distillation ``step``), for the ledger
    config: dict[str, Any] = field(default_factory=dict)


def run_exchange_rounds(
    method: ExchangeMethod,
    sites: list[SiteRuntime],
    rounds: int,
    *,
    state: WeightSet | None = None,
    first_round: int = 1,
    progress: ProgressFn | None = None,
    cancel: Callable[[], bool] | None = None,
    recorder: Callable[[ExchangeRecord], None] | None = None,
) -> tuple[WeightSet, list[RoundRecord]]:
    """Run rounds ``first_round..rounds`` of a dialogue method over ``sites`` in this process.

    Every request goes through the site half (:meth:`ExchangeMethod.check_request`, then
    :meth:`ExchangeMethod.answer`) and every reply through
    :meth:`ExchangeMethod.validate_reply`; a site that raises or answers badly is reported
    to the dialogue as a :class:`~engine.fl.exchange.Failure` (and as an ``error`` event).

    Parameters
    ----------
    recorder
        Called with an :class:`ExchangeRecord` for every request (the ledger's view).

    Returns
    -------
    state, records
        Final server state and one :class:`RoundRecord` per round (bytes summed over the
        round's exchanges; ``metrics`` = each site's last reply metrics plus ``exchanges``).
    """
    by_name = {s.name: s for s in sites}
    state = method.initial_state() if state is None else state
    records: list[RoundRecord] = []
    for rnd in range(first_round, rounds + 1):
        if cancel is not None and cancel():
            raise CancelledError(f"{method.name}: cancelled before round {rnd}")
        start = time.perf_counter()
        if progress:
            progress({"event": "round_start", "method": method.name, "round": rnd, "rounds": rounds})
        to_site: dict[str, int] = {}
        from_site: dict[str, int] = {}
        train_s: dict[str, float] = {}
        failed: dict[str, str] = {}
        metrics: dict[str, dict[str, float]] = {}
        exchanges: dict[str, int] = {}
        dialogue = method.dialogue(state, rnd)
        try:
            requests = next(dialogue)
            while True:
                answers: dict[str, Reply | Failure] = {}
                for name, request in requests.items():
                    sent = tensor_bytes(request.tensors)
                    to_site[name] = to_site.get(name, 0) + sent
                    exchanges[name] = exchanges.get(name, 0) + 1
                    site = by_name.get(name)
                    t0 = time.perf_counter()
                    try:
                        if site is None:
                            raise FedSMError(f"{name} is not a site of this federation")
                        method.check_request(request)
                        reply = method.answer(request, site, progress, cancel)
                        method.validate_reply(request, name, reply)
                    except CancelledError:
                        raise
                    except (FedSMError, WeightsError, RuntimeError) as exc:
                        log.warning("round %d: %s failed %r: %s", rnd, name, request.action, exc)
                        failed[name] = str(exc)
                        answers[name] = Failure(str(exc))
                        if progress:
                            progress({"event": "error", "method": method.name, "round": rnd, "site": name,
                                      "message": str(exc)})
                        if recorder:
                            recorder(ExchangeRecord(rnd, name, request.action, _shapes(request.tensors), {},
                                                    sent, 0, str(exc), dict(request.config)))
                        continue
                    train_s[name] = train_s.get(name, 0.0) + time.perf_counter() - t0
                    got = tensor_bytes(reply.tensors)
                    from_site[name] = from_site.get(name, 0) + got
                    metrics[name] = dict(reply.metrics)
                    answers[name] = reply
                    if recorder:
                        recorder(ExchangeRecord(rnd, name, request.action, _shapes(request.tensors),
                                                _shapes(reply.tensors), sent, got, config=dict(request.config)))
                requests = dialogue.send(answers)
        except StopIteration as stop:
            state = stop.value
        for name, count in exchanges.items():
            metrics.setdefault(name, {})["exchanges"] = float(count)
        answered = sorted(n for n in metrics if n not in failed and n in from_site)
        record = RoundRecord(rnd, answered, failed, to_site, from_site, metrics, time.perf_counter() - start,
                             train_s)
        records.append(record)
        if progress:
            progress({"event": "round_end", "method": method.name, "round": rnd, "rounds": rounds,
                      "answered": record.answered, "bytes_to_sites": sum(to_site.values()),
                      "bytes_from_sites": sum(from_site.values()), "wall_s": round(record.wall_s, 3),
                      "metrics": record.metrics})
    return state, records


def _shapes(tensors: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}
