"""Dialogue methods over Flower: one message per :class:`~engine.fl.exchange.Request`.

Any :class:`~engine.fl.exchange.ExchangeMethod` (BlackFed, FedIOD) runs over the same
federation as FedSM: the coordinator's :class:`DialogueRunner` drives the method's round
generator, sends each request as its own Flower message of type ``train.exchange`` to the
addressed site's node, and hands the decoded, validated replies (or a
:class:`~engine.fl.exchange.Failure` with the reason) back to the generator. At the site,
:func:`answer_exchange` rebuilds the method from the run's spec, refuses undeclared tensors
(:meth:`~engine.fl.exchange.ExchangeMethod.check_request`), calls the method's ``answer`` with the
site's data and private state, and records every reply in the site's outbound ledger
(``sent`` events: bytes and what each tensor *is*, from ``REPLY_CONTENTS``).

Request (coordinator -> site, ``train.exchange``)::

    "fedsm"             ConfigRecord   round, rounds, method, spec, session, run_id, site, action, config (JSON),
                                       exchange
    "weights:request"   ArrayRecord    the request's tensors (absent when it has none)
    "layout"            ConfigRecord   tensor names, dtypes, shapes

Reply (site -> coordinator)::

    "fedsm"             ConfigRecord   site, round, exchange
    "metrics"           MetricRecord   the reply's metrics and "num-examples"
    "weights:reply"     ArrayRecord    the reply's tensors (absent when it has none)
    "layout"            ConfigRecord

After the last round, a method that declares ``FINAL_CONTENTS`` (BlackFed: the server net the site
segments with; FedIOD: the student) sends each connected site those weights ONCE, in a ``query``
message with action ``final_model`` (:meth:`DialogueRunner.deliver_final`, records as a ``train``
instruction's). The site checks them (declared parts only, finite, the run's shapes), assembles its
bundle (BlackFed: its own client net with that server net; FedIOD: the student) and writes it
atomically into its work folder (:func:`receive_final`): a ``received`` event (``final: true``) in
its ledger with the bytes and what each part is, a ``status`` event with the bundle's path
(``bundle``), and an empty ``sent`` acknowledgement (``final: true``). These are the only weights
the coordinator of a dialogue method ever sends.

Every exchange is a round trip through the SuperLink (the site's SuperNode polls for it), so a
dialogue method's wall time is dominated by ``exchanges x round-trip`` over the network; see
``docs/federation.md``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from engine.bundle import check_site_name, save_bundle
from engine.bundle.split import SplitBundle, save_split_bundle
from engine.errors import CancelledError, ConfigError, FedSMError, WeightsError
from engine.federation.checkpoint import Checkpoint, load_site_state_before, save_site_state
from engine.federation.events import PendingReport
from engine.federation.flower import records
from engine.federation.flower.grid_exchange import QUERY, exchange
from engine.federation.flower.server_app import CheckpointWriter, FederationRunner
from engine.federation.flower.upload_limits import MIN_REPLY_LIMIT
from engine.fl.exchange import ExchangeMethod, Failure, Reply, Request, tensor_bytes
from engine.fl.methods import SiteInstructions, SiteRuntime
from engine.fl.weights import all_finite

if TYPE_CHECKING:
    from flwr.serverapp import Grid

    from engine.fl.methods import WeightSet

log = logging.getLogger(__name__)

#: Flower message type of one exchange (a ``train`` category with its own action).
EXCHANGE = "train.exchange"
#: ``query`` action of the end-of-run message that carries a dialogue method's final models to a site.
FINAL_ACTION = "final_model"
REQUEST_PART = "request"
REPLY_PART = "reply"


# --- encoding --------------------------------------------------------------------------------
def encode_request(request: Request, *, rnd: int, rounds: int, method: str, spec_json: str, session: str,
                   site: str, exchange_id: int, run_id: str = "") -> RecordDict:
    """The content of one ``train.exchange`` message (``run_id``: the one the coordinator signed)."""
    info = ConfigRecord({"round": int(rnd), "rounds": int(rounds), "method": method, "spec": spec_json,
                         "session": session, "run_id": run_id, "site": site, "action": request.action,
                         "config": json.dumps(request.config, sort_keys=True), "exchange": int(exchange_id)})
    parts = {REQUEST_PART: request.tensors} if request.tensors else {}
    return RecordDict({records.INFO: info, **records.weights_records(parts)})


def _tensors(content: RecordDict, part: str, what: str) -> dict[str, Any]:
    layouts = content.config_records.get(records.LAYOUT)
    if layouts is None:
        raise WeightsError(f"{what}: no tensor layout record")
    unknown = sorted(set(content.array_records) - {records.WEIGHTS_PREFIX + part})
    if unknown or sorted(layouts) not in ([], [part]):
        raise WeightsError(f"{what}: unexpected parts {unknown or sorted(layouts)}")
    record = content.array_records.get(records.WEIGHTS_PREFIX + part)
    if record is None:
        if layouts:
            raise WeightsError(f"{what}: a layout without tensors")
        return {}
    return records.unpack(record, layouts.get(part), f"{what}, {part}")


def decode_request(content: RecordDict) -> tuple[dict[str, Any], Request]:
    """``(info, request)`` of a ``train.exchange`` message (raises :class:`WeightsError` when malformed)."""
    info = content.config_records.get(records.INFO)
    if info is None:
        raise WeightsError("exchange without its 'fedsm' settings record; is the coordinator a FedSM server?")
    allowed = (records.INFO, records.LAYOUT, records.WEIGHTS_PREFIX + REQUEST_PART)
    unknown = sorted(k for k in content if k not in allowed)
    if unknown:
        raise WeightsError(f"exchange has unexpected records {unknown}")
    try:
        fields = {k: info[k] for k in ("round", "rounds", "method", "spec", "session", "site", "action", "exchange")}
        fields["run_id"] = str(info.get("run_id", ""))
        config = json.loads(str(info["config"]))
    except (KeyError, ValueError) as exc:
        raise WeightsError(f"malformed exchange ({exc})") from None
    if not isinstance(config, dict):
        raise WeightsError("malformed exchange: its config is not a JSON object")
    return fields, Request(str(fields["action"]), _tensors(content, REQUEST_PART, "exchange request"), config)


def encode_reply(reply: Reply, *, site: str, rnd: int, exchange_id: int) -> RecordDict:
    """The content of a site's answer to one exchange."""
    metrics: dict[str, int | float] = {k: float(v) for k, v in reply.metrics.items()}
    metrics[records.NUM_EXAMPLES] = int(reply.num_samples)
    parts = {REPLY_PART: reply.tensors} if reply.tensors else {}
    return RecordDict({records.INFO: ConfigRecord({"site": site, "round": int(rnd), "exchange": int(exchange_id)}),
                       records.METRICS: MetricRecord(metrics), **records.weights_records(parts)})


def decode_reply(content: RecordDict, site: str, rnd: int, exchange_id: int) -> Reply:
    """Decode ``site``'s answer strictly (:class:`WeightsError` otherwise)."""
    what = f"answer of {site} (round {rnd}, exchange {exchange_id})"
    unknown = sorted(k for k in content
                     if k not in (records.INFO, records.METRICS, records.LAYOUT, records.WEIGHTS_PREFIX + REPLY_PART))
    if unknown:
        raise WeightsError(f"{what} has unexpected records {unknown}")
    info = content.config_records.get(records.INFO)
    metrics_record = content.metric_records.get(records.METRICS)
    if info is None or metrics_record is None:
        raise WeightsError(f"{what} lacks its 'fedsm' or 'metrics' record")
    if info.get("site") != site or info.get("round") != rnd or info.get("exchange") != exchange_id:
        raise WeightsError(f"{what} claims site {info.get('site')!r}, round {info.get('round')!r}, "
                           f"exchange {info.get('exchange')!r}")
    metrics: dict[str, float] = {}
    for key, value in metrics_record.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WeightsError(f"{what}: metric {key!r} is not a number")
        metrics[key] = float(value)
    num = metrics.pop(records.NUM_EXAMPLES, None)
    if num is None or not math.isfinite(num) or num != int(num) or num < 0:
        raise WeightsError(f"{what}: '{records.NUM_EXAMPLES}' must be a non-negative integer, got {num}")
    return Reply(_tensors(content, REPLY_PART, what), metrics, int(num))


def dialogue_reply_limit(method: ExchangeMethod) -> int:
    """The coordinator's upload limit for a dialogue method: its largest reply doubled plus 16 MiB (>= 128 MiB)."""
    largest = method.max_reply_bytes()
    if largest is None:
        return MIN_REPLY_LIMIT
    return max(int(2 * largest + 16 * 2**20), MIN_REPLY_LIMIT)


# --- coordinator -----------------------------------------------------------------------------
class DialogueRunner(FederationRunner):
    """:class:`FederationRunner` for an :class:`ExchangeMethod`: a round is the method's dialogue.

    Sites that are offline, time out, answer with an error or with a reply the method refuses
    reach the dialogue as :class:`~engine.fl.exchange.Failure` (the method decides what a
    missing answer means: BlackFed ends that site's turn). Checkpoints, ``round_start`` /
    ``round_end`` events and the summary are the same as for one-exchange methods.
    """

    method: ExchangeMethod  # type: ignore[assignment]

    #: After :meth:`run`: per site, what the end-of-run message delivered (``bytes``, ``parts``) or why not.
    final_delivery: dict[str, dict[str, Any]]

    def run(self, grid: Grid, resume: Checkpoint | None = None) -> WeightSet:
        """The method's rounds, then each connected site's final models (:meth:`deliver_final`)."""
        state = super().run(grid, resume)
        self.final_delivery = self.deliver_final(grid, state)
        return state

    def deliver_final(self, grid: Grid, state: WeightSet) -> dict[str, dict[str, Any]]:
        """Send every connected site the method's ``final_models`` once (``query``, action ``final_model``).

        A site that is offline, does not answer within ``round_timeout`` or answers with an error
        gets no bundle (an ``error`` event says why); the run's result does not depend on it.
        """
        final_models = getattr(self.method, "final_models", None)
        declared = getattr(self.method, "FINAL_CONTENTS", {})
        if final_models is None or not declared:
            return {}
        total = self.method.total_rounds
        online = self.online_sites(grid)
        outcome: dict[str, dict[str, Any]] = {site: {"delivered": False, "reason": "not connected"}
                                              for site in self.sites if site not in online}
        outcome |= {site: {"delivered": False, "reason": "its operator declined this run"} for site in self.declined}
        messages: dict[str, Message] = {}
        for site in self.sites:
            if site not in online or site in self.declined:
                continue
            parts = final_models(state, site)
            self._check_final_parts(parts)
            content = records.encode_instructions(SiteInstructions(total, parts, {"phase": FINAL_ACTION}),
                                                  rounds=total, method=self.method.name, spec_json=self.spec_json,
                                                  session=self.session, site=site, run_id=self.run_id)
            content.config_records[records.INFO]["action"] = FINAL_ACTION
            size = records.record_bytes(content)
            outcome[site] = {"delivered": False, "bytes": size, "parts": sorted(parts)}
            messages[site] = Message(content, dst_node_id=online[site], message_type=QUERY, group_id=str(total),
                                     ttl=self.settings.round_timeout)
            self.events.emit("sent", site=site, round=total, rounds=total, method=self.method.name, bytes=size,
                             final=True, contents=records.record_contents(content))
        if not messages:
            return outcome
        self.events.status(f"sending the final models ({', '.join(sorted(declared))}) to {len(messages)} site(s) "
                           "once; each assembles its own bundle")

        def on_reply(site: str, reply: Message) -> None:
            if reply.has_error():
                outcome[site]["reason"] = f"the site answered with an error: {reply.error.reason}"
                self.events.error(f"no bundle at the site: {outcome[site]['reason']}", site=site, round=total)
            else:
                outcome[site]["delivered"] = True

        _, missing = exchange(grid, messages, self.settings.round_timeout, self.settings.poll_interval,
                              self._check_cancel_flag, on_reply)
        for site, reason in missing.items():
            outcome[site]["reason"] = reason
            self.events.error(f"no bundle at the site: the final models were not acknowledged ({reason})", site=site,
                              round=total)
        return {site: outcome[site] for site in self.sites if site in outcome}

    def _check_final_parts(self, parts: dict[str, Any]) -> None:
        """The coordinator sends only the parts the method declares in ``FINAL_CONTENTS``."""
        declared = getattr(self.method, "FINAL_CONTENTS", {})
        if sorted(parts) != sorted(declared):
            raise FedSMError(f"{self.method.name}: final models {sorted(parts)} differ from the declared "
                             f"{sorted(declared)}")

    def _round(self, grid: Grid, state: WeightSet, rnd: int, writer: CheckpointWriter) -> WeightSet:
        total = self.method.total_rounds
        started = time.monotonic()
        self.events.emit("round_start", round=rnd, rounds=total, method=self.method.name)
        self.wait_for_rejoin(grid)
        online = self.online_sites(grid)
        left_out: dict[str, str] = {}
        counts: dict[str, int] = {}
        bytes_to: dict[str, int] = {}
        bytes_from: dict[str, int] = {}
        before = state
        dialogue = self.method.dialogue(state, rnd)
        exchange_id = 0
        answers: dict[str, Reply | Failure] = {}
        try:
            requests = _advance(dialogue, None)
            while True:
                self._check_cancel()
                answers: dict[str, Reply | Failure] = {}
                messages: dict[str, Message] = {}
                sent: dict[str, Request] = {}
                for site, request in requests.items():
                    exchange_id += 1
                    if site not in online:
                        online = self.online_sites(grid)
                    if site not in online:
                        answers[site] = Failure("not connected")
                        left_out[site] = "not connected"
                        continue
                    self.method.check_request(request)  # the coordinator sends only what the method declares
                    content = encode_request(request, rnd=rnd, rounds=total, method=self.method.name,
                                             spec_json=self.spec_json, session=self.session, site=site,
                                             exchange_id=exchange_id, run_id=self.run_id)
                    bytes_to[site] = bytes_to.get(site, 0) + records.record_bytes(content)
                    counts[site] = counts.get(site, 0) + 1
                    messages[site] = self._message(content, online[site], rnd)
                    sent[site] = request
                ids = {site: int(m.content.config_records[records.INFO]["exchange"]) for site, m in messages.items()}
                replies, missing = exchange(grid, messages, self.settings.round_timeout, self.settings.poll_interval,
                                            self._check_cancel_flag)
                for site, reason in missing.items():
                    answers[site] = Failure(reason)
                    left_out[site] = reason
                    self.events.error(f"round {rnd}: {reason}", site=site, round=rnd)
                for site, message in replies.items():
                    answers[site] = self._decode(message, sent[site], site, rnd, ids[site], left_out)
                    if not isinstance(answers[site], Failure):
                        bytes_from[site] = bytes_from.get(site, 0) + tensor_bytes(answers[site].tensors)
                requests = _advance(dialogue, answers)
        except StopIteration as stop:
            state = stop.value
            broken = _not_finite(state)
            if broken is not None:  # e.g. finite but huge activations that the server net cannot absorb
                state = self._discard_round(rnd, before, f"its result holds NaN or Inf ({broken})", counts, left_out)
        except DialogueFailed as exc:
            # the method could not go on with what the sites answered: the round is discarded, never the run
            suspects = sorted(site for site, a in answers.items() if not isinstance(a, Failure))
            state = self._discard_round(rnd, before, str(exc), suspects or counts, left_out)
        wall_s = time.monotonic() - started
        answered = sorted(s for s in counts if s not in left_out)
        record = {"round": rnd, "answered": answered, "left_out": left_out, "wall_s": round(wall_s, 3),
                  "exchanges": counts, "bytes_to_sites": sum(bytes_to.values()),
                  "bytes_from_sites": sum(bytes_from.values())}
        self.history.append(record)
        writer.submit(Checkpoint(rnd, state, self.spec_json, self.session, self.app_hash, list(self.history)),
                      self.checkpoint_path)
        self.events.emit("round_end", round=rnd, rounds=total, method=self.method.name, wall_s=round(wall_s, 3),
                         answered=answered, left_out=left_out, exchanges=counts)
        return state

    def _discard_round(self, rnd: int, before: WeightSet, reason: str, sites: Any,
                       left_out: dict[str, str]) -> WeightSet:
        """Keep the state from before round ``rnd``; leave ``sites`` out with ``reason`` (``error`` events)."""
        message = f"round {rnd} is discarded and the model kept as it was before it: {reason}"
        log.warning(message)
        for site in sorted(sites):
            left_out[site] = message
            self.events.error(message, site=site, round=rnd)
        return before

    def _message(self, content: RecordDict, node: int, rnd: int) -> Message:
        return Message(content, dst_node_id=node, message_type=EXCHANGE, group_id=str(rnd),
                       ttl=self.settings.round_timeout)

    def _decode(self, message: Message, request: Request, site: str, rnd: int, exchange_id: int,
                left_out: dict[str, str]) -> Any:
        if message.has_error():
            reason = f"the site answered with an error: {message.error.reason}"
        else:
            try:
                reply = decode_reply(message.content, site, rnd, exchange_id)
                self.method.validate_reply(request, site, reply)
                self.screen.check_count(site, reply.num_samples, "answer", allow_zero=True)  # engine.fl.robust
                return reply
            except (FedSMError, WeightsError) as exc:
                reason = f"answer rejected: {exc}"
            except Exception as exc:  # whatever a site sends, the coordinator goes on
                reason = f"answer rejected: it does not decode ({type(exc).__name__}: {exc})"
        left_out[site] = reason
        self.events.error(reason, site=site, round=rnd)
        return Failure(reason)


class DialogueFailed(FedSMError):
    """The method's dialogue raised while taking the sites' answers (or starting the round)."""


def _advance(dialogue: Any, answers: Any) -> Any:
    """The dialogue's next requests; :class:`DialogueFailed` for any error of the method's own code.

    ``StopIteration`` (the round's result) and :class:`CancelledError` pass through unchanged.
    """
    try:
        return next(dialogue) if answers is None else dialogue.send(answers)
    except (StopIteration, CancelledError):
        raise
    except Exception as exc:
        raise DialogueFailed(f"the {type(exc).__name__} of the method on the sites' answers: {exc}") from exc


def _not_finite(state: Any) -> str | None:
    """The first tensor of ``state`` (``{part: {name: tensor}}``) holding NaN or Inf, as ``part/name``."""
    for part, tensors in state.items():
        if not isinstance(tensors, dict):
            continue
        for name, tensor in tensors.items():
            if isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point and \
                    not bool(torch.isfinite(tensor).all()):
                return f"{part}/{name}"
    return None


# --- site ------------------------------------------------------------------------------------
def answer_exchange(worker: Any, content: RecordDict) -> RecordDict:
    """Site half of one exchange: rebuild the method, answer with the site's data, record what leaves.

    ``worker`` is the site's :class:`engine.fl.client_app.SiteWorker`; the site's runtime (its
    private state: BlackFed's client net) lives in the worker between exchanges and is saved
    after every answer (``state/<session>/after-round-N``), so a restarted site resumes from
    the round before.
    """
    received_at = time.monotonic()
    info, request = decode_request(content)
    site, rnd, exchange_id = str(info["site"]), int(info["round"]), int(info["exchange"])
    if site != worker.cfg.name:
        raise ConfigError(f"the coordinator addressed this exchange to site {site!r}, but this is "
                          f"{worker.cfg.name!r}; check the site name enrolled for this key")
    check = getattr(worker, "check_signed", None)  # a SiteWorker: the exchange must belong to the signed run
    if check is not None:
        check(str(info["spec"]), str(info["session"]), str(info["run_id"]), "exchange")
    method, spec = worker.method(str(info["spec"]))
    if not isinstance(method, ExchangeMethod):
        raise ConfigError(f"method {spec.method!r} is not a dialogue method; the coordinator sent an exchange")
    if method.SHARES_ACTIVATIONS and not getattr(worker.cfg, "share_activations", False):
        raise ConfigError(f"{spec.method} sends activations of this site's images and their masks to the "
                          "coordinator, and this site has not agreed to that; read docs/federation.md (split "
                          "learning) and set [site] share_activations = true to take part")
    method.check_request(request)  # refuse anything the method does not declare before using it
    session = str(info["session"])
    runtimes: dict[tuple[str, str], SiteRuntime] = worker.__dict__.setdefault("_dialogue_runtimes", {})
    data = worker.data(spec.task, spec.image_size)
    key = (session, str(info["spec"]))
    runtime = runtimes.get(key)
    if runtime is None:
        runtime = SiteRuntime(worker.cfg.name, spec.site_names.index(worker.cfg.name), data.train,
                              load_site_state_before(worker.state_dir, session, rnd), validation=data.validation)
        if getattr(worker.cfg, "privacy", None) is not None:  # site.toml [privacy], used by FedIOD's site half
            runtime.state["privacy"] = worker.cfg.privacy
        runtimes[key] = runtime
    worker.events.emit("received", round=rnd, rounds=int(info["rounds"]), method=str(info["method"]),
                       bytes=records.record_bytes(content), action=request.action, exchange=exchange_id,
                       contents={"tensors": {k: method.REQUEST_CONTENTS[k] for k in request.tensors}})
    started = time.monotonic()
    try:
        reply = method.answer(request, runtime, None, worker.cancel)
    except CancelledError:
        raise
    save_site_state(worker.state_dir, session, rnd, runtime.state)
    answer_s = time.monotonic() - started
    out = encode_reply(reply, site=site, rnd=rnd, exchange_id=exchange_id)

    def report() -> None:
        worker.events.emit("sent", round=rnd, bytes=records.record_bytes(out), action=request.action,
                           exchange=exchange_id, answer_s=round(answer_s, 4),
                           wall_s=round(time.monotonic() - received_at, 4),
                           contents={"tensors": {k: method.REPLY_CONTENTS.get(k, "?") for k in reply.tensors},
                                     "shapes": {k: list(v.shape) for k, v in reply.tensors.items()},
                                     "num_examples": reply.num_samples, "metrics": sorted(reply.metrics)})

    worker.after_reply = PendingReport(report)
    return out


def site_bundle_path(work_dir: Any, method: str, session: str) -> Any:
    """Where a site writes the bundle of a dialogue run: ``<work_dir>/models/<method>-<session[:12]>.safetensors``."""
    check_site_name(session)  # a session id names a file: letters, digits, '-', '_' only
    return Path(work_dir) / "models" / f"{method}-{session[:12]}.safetensors"


def receive_final(worker: Any, content: RecordDict) -> RecordDict:
    """Site half of the end-of-run message: check the final models, assemble and write this site's bundle.

    The message must be addressed to this site, carry the run's signed settings, and hold exactly
    the method's ``FINAL_CONTENTS`` parts, finite, in the run's shapes; anything else is refused
    with an error reply and nothing is written. The bundle is written atomically (temporary file,
    then rename) to :func:`site_bundle_path`; the ``received`` event puts the message in the site's
    ledger, a ``status`` event carries the path (``bundle``), and the acknowledgement (no tensor,
    no metric) is a ``sent`` event of 0 bytes.
    """
    ins = worker.addressed_instructions(content, "final message")
    method, spec = worker.method(ins.spec_json)
    declared = getattr(method, "FINAL_CONTENTS", {})
    if not isinstance(method, ExchangeMethod) or not declared:
        raise ConfigError(f"method {spec.method!r} sends no final models; the coordinator sent some")
    received = ins.instructions.weights
    if sorted(received) != sorted(declared):
        raise WeightsError(f"the coordinator's final models hold {sorted(received)}; {spec.method} declares "
                           f"{sorted(declared)}; refusing them")
    for part, weights in received.items():
        if not all(all_finite(t) for t in weights.values() if t.dtype.is_floating_point):
            raise WeightsError(f"the coordinator's final {part} holds NaN or Inf; refusing it")
    size = records.record_bytes(content)
    # ``final`` rather than an exchange's ``action``: the one message of the run that carries weights to the site
    worker.events.emit("received", round=ins.round, rounds=ins.rounds, method=ins.method, bytes=size, final=True,
                       contents={"tensors": {k: declared[k] for k in received}})
    runtimes: dict[tuple[str, str], SiteRuntime] = worker.__dict__.setdefault("_dialogue_runtimes", {})
    runtime = runtimes.get((ins.session, ins.spec_json))
    if runtime is None:  # the site restarted since its last answer: its private state from disk
        data = worker.data(spec.task, spec.image_size)
        runtime = SiteRuntime(worker.cfg.name, spec.site_names.index(worker.cfg.name), data.train,
                              load_site_state_before(worker.state_dir, ins.session, ins.rounds + 1),
                              validation=data.validation)
    bundle = method.site_bundle(received, runtime, spec.image_size,
                                {"session": ins.session, "seed": spec.seed, "trained_by": "fedsm site",
                                 "rounds": ins.rounds})
    path = site_bundle_path(worker.cfg.work_dir, spec.method, ins.session)
    digest = _save_any_bundle(path, bundle)
    worker.events.status(f"{spec.method} bundle written to {path} (open it in the app or with 'fedsm infer "
                         f"--model {path}" + (f" --site {worker.cfg.name}'" if hasattr(bundle, "clients") else "'")
                         + ")", bundle=str(path), sha256=digest, method=spec.method, round=ins.rounds)
    out = RecordDict({records.INFO: ConfigRecord({"site": worker.cfg.name, "round": int(ins.rounds)}),
                      records.METRICS: MetricRecord({})})

    def report() -> None:
        worker.events.emit("sent", round=ins.rounds, bytes=records.record_bytes(out), final=True,
                           contents={"tensors": {}, "metrics": []})

    worker.after_reply = PendingReport(report)
    return out


def _save_any_bundle(path: Any, bundle: Any) -> str:
    """Write a split bundle or a (single-model) super-model bundle atomically; its SHA-256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(bundle, SplitBundle):
        return save_split_bundle(path, bundle)
    return save_bundle(path, bundle)


__all__ = [
    "EXCHANGE",
    "FINAL_ACTION",
    "DialogueRunner",
    "answer_exchange",
    "decode_reply",
    "decode_request",
    "dialogue_reply_limit",
    "encode_reply",
    "encode_request",
    "receive_final",
    "site_bundle_path",
]
