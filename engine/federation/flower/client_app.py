"""The FedSM ClientApp: a thin shim from Flower messages to the installed engine.

A ``train`` message is decoded (:mod:`engine.federation.flower.records`), the method is built
from the coordinator's spec exactly as ``fedsm simulate`` builds it
(:func:`engine.federation.spec.build_method`), and the method's site half
(:meth:`~engine.fl.methods.FederatedMethod.train_at_site`) runs on the site's own data. The
reply holds the method's weights, the training sample count and numeric metrics: nothing
else leaves the site (no image, no mask, no path; an error is reported to the coordinator
without its details, which stay in the site's own log).

``query`` messages: ``identify`` (insecure mode: the site tells its name), ``evaluate`` (the final
models' Dice on the site's validation and testing images, numbers only; see
:mod:`engine.federation.flower.final_evaluation`), ``final_model`` (a dialogue method's final
models, from which the site writes its bundle; :func:`engine.federation.flower.dialogue.receive_final`)
and ``finished`` (the run is over).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from engine.data.datalist import outside_paths_allowed
from engine.data.site_data import load_site
from engine.errors import CancelledError, ConfigError, DataError, WeightsError
from engine.federation.checkpoint import load_site_state_before, save_site_state
from engine.federation.events import EventWriter, PendingReport
from engine.federation.flower import records
from engine.federation.flower.dialogue import answer_exchange, receive_final
from engine.federation.spec import MethodSpec, build_method
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.methods import SiteInstructions, SiteRuntime, SiteUpdate
from engine.fl.wire_precision import decode_down, encode_up
from engine.security.approval import AppNotApproved
from engine.startup import import_compute_stack
from engine.tasks import get_task

if TYPE_CHECKING:
    from flwr.app import Context

    from engine.data.site_data import SiteData
    from engine.federation.config import SiteConfig
    from engine.fl.methods import FederatedMethod

log = logging.getLogger(__name__)

#: Errors whose message may be shown to the coordinator (they name no local file).
_SHAREABLE_ERRORS = (WeightsError,)


@dataclass
class SiteWorker:
    """The site's half of the federation: its data, the methods it was asked to run, its private state.

    Parameters
    ----------
    cfg
        The site's configuration.
    events
        Progress events (``source="site"``).
    cancel
        Returns ``True`` when the site is being stopped.
    validate
        Compute validation Dice after each round (``metrics`` events).
    """

    cfg: SiteConfig
    events: EventWriter
    cancel: Callable[[], bool] | None = None
    validate: bool = True
    finished: bool = False
    _data: dict[tuple[str, int], SiteData] = field(default_factory=dict)
    _methods: dict[str, FederatedMethod] = field(default_factory=dict)
    after_reply: PendingReport | None = None
    #: the run's settings as the coordinator signed them (engine.security.run_spec); every message must carry them
    signed_spec: str | None = None
    #: the signed run's session and run id (engine.security.run_spec); every message must carry them too
    signed_run: tuple[str, str] | None = None

    # --- pieces ------------------------------------------------------------------------
    def data(self, task: str, image_size: int, fundus_crop: str = "none") -> SiteData:
        """The site's data at ``image_size`` (loaded once, through the same path as training and inference)."""
        key = (task, image_size, fundus_crop)
        if key not in self._data:
            self.events.status(f"loading {self.cfg.datalist.name} at {image_size} px")
            # the datalist's containment as the operator set it ([site] allow_outside; off by default)
            with outside_paths_allowed(self.cfg.allow_outside):
                self._data[key] = load_site(self.cfg.datalist, get_task(task), image_size, name=self.cfg.name,
                                            fundus_crop=fundus_crop)
        return self._data[key]

    def addressed_instructions(self, content: Any, what: str = "message") -> Any:
        """Decode a message's instructions; refuse one addressed to another site, or whose run settings
        differ from the ones the coordinator signed for this run."""
        ins = records.decode_instructions(content)
        if ins.site != self.cfg.name:
            raise ConfigError(f"the coordinator addressed this {what} to site {ins.site!r}, but this is "
                              f"{self.cfg.name!r}; check the site name enrolled for this key")
        self.check_signed(ins.spec_json, ins.session, ins.run_id, what)
        return ins

    def check_signed(self, spec_json: str, session: str, run_id: str, what: str = "message") -> None:
        """Refuse a message whose settings, session or run id differ from the ones the coordinator signed."""
        if self.signed_spec is not None and spec_json != self.signed_spec:
            raise ConfigError(f"the {what}'s run settings differ from the ones the coordinator signed for this run; "
                              "refusing it")
        if self.signed_run is not None and (session, run_id) != self.signed_run:
            raise ConfigError(f"the {what} belongs to run {run_id[:12] or '(none)'}… of session {session[:12]}…, "
                              f"not to the run the coordinator signed ({self.signed_run[1][:12]}… of session "
                              f"{self.signed_run[0][:12]}…); refusing it")

    def method(self, spec_json: str) -> tuple[FederatedMethod, Any]:
        spec = MethodSpec.from_json(spec_json)
        if spec.task != self.cfg.task:
            raise ConfigError(f"the coordinator runs task {spec.task!r} but this site's data is for {self.cfg.task!r}; "
                              "join a federation of your task or fix [site] task")
        if self.cfg.name not in spec.site_names:
            raise ConfigError(f"the coordinator's run does not include site {self.cfg.name!r} "
                              f"(sites: {', '.join(spec.site_names)})")
        if spec_json not in self._methods:
            import_compute_stack()  # the first run this site trains for: MONAI and the optimizers (engine.startup)
            self._methods[spec_json] = build_method(spec, self.cfg.device)
        return self._methods[spec_json], spec

    @property
    def state_dir(self) -> Any:
        return self.cfg.work_dir / "state"

    # --- train -------------------------------------------------------------------------
    def train(self, content: Any) -> Any:
        """Handle a ``train`` message's content; return the reply content."""
        received_at = time.monotonic()
        ins = self.addressed_instructions(content)
        method, spec = self.method(ins.spec_json)
        rnd, total = ins.round, ins.rounds
        self.events.emit("received", round=rnd, rounds=total, method=ins.method, bytes=records.record_bytes(content),
                         contents=records.record_contents(content))
        self.events.emit("round_start", round=rnd, rounds=total, method=ins.method)
        data = self.data(spec.task, spec.image_size, spec.fundus_crop)
        runtime = SiteRuntime(self.cfg.name, spec.site_names.index(self.cfg.name), data.train,
                              load_site_state_before(self.state_dir, ins.session, rnd), validation=data.validation)

        def progress(event: dict[str, Any]) -> None:
            if event.get("event") == "batch":
                self.events.emit("batch", round=rnd, batch=event["batch"], batches=event["batches"],
                                 loss=event.get("loss", {}), method=ins.method)

        # 16-bit values in, 16-bit differences from them out (engine.fl.wire_precision)
        wire = method.wire_parts(rnd)
        received = SiteInstructions(rnd, decode_down(ins.instructions.weights, wire), ins.instructions.config)
        started = time.monotonic()
        update = method.train_at_site(received, runtime, progress, self.cancel)
        train_s = time.monotonic() - started
        save_site_state(self.state_dir, ins.session, rnd, runtime.state)
        wire_update = SiteUpdate(encode_up(update.weights, received.weights, wire), update.num_samples, update.metrics)
        reply = records.encode_update(_with_timing(wire_update, train_s), site=self.cfg.name, rnd=rnd)

        def report() -> None:
            wall_s = time.monotonic() - received_at  # received -> answer handed to the SuperNode
            loss = {k: v for k, v in update.metrics.items() if k.startswith("loss")}
            self.events.emit("sent", round=rnd, bytes=records.record_bytes(reply), contents={
                "tensors": records.record_contents(reply), "num_examples": update.num_samples,
                "metrics": sorted(update.metrics)})
            dice = (self._validation_dice(method, received.weights, update, runtime, data)
                    if self.validate else {})
            self.events.emit("metrics", round=rnd, loss=loss, dice=dice, train_s=round(train_s, 3))
            self.events.emit("round_end", round=rnd, rounds=total, wall_s=round(wall_s, 3))

        self.after_reply = PendingReport(report)
        return reply

    def _validation_dice(self, method: FederatedMethod, received: dict[str, Any], update: SiteUpdate,
                         runtime: Any, data: SiteData) -> dict[str, float]:
        """Validation Dice of the received global model, the personalized model and the locally trained one."""
        split = data.validation
        if not len(split.images):
            return {}
        models: dict[str, Any] = {}
        if "global" in received:
            models["global"] = received["global"]
        own = getattr(method, "personal_model_now", None)  # FedSM's; other methods receive no personal model
        personal = own(received, runtime.state) if own is not None else received.get("personal")
        if personal is not None:
            models["personalized"] = personal
        if "personal" in update.weights:
            models["local"] = update.weights["personal"]
        elif "global" in update.weights:
            models["local"] = update.weights["global"]
        elif "local_model" in runtime.state:
            models["local"] = runtime.state["local_model"]
            models.setdefault("personalized", runtime.state["local_model"])
        out = {}
        for name, weights in models.items():
            masks = segment_with(method.task, weights, split.images, self.cfg.device)
            out[name] = float(np.mean(dice_per_case(masks, split.masks, split.case_ids)))
        return out

    # --- query -------------------------------------------------------------------------
    def query(self, content: Any) -> Any:
        info = content.config_records.get(records.INFO, {})
        action = info.get("action")
        if action == "evaluate":
            return evaluate_at_site(self, content)
        if action == "final_model":  # a dialogue method's end: assemble this site's bundle (dialogue.py)
            return receive_final(self, content)
        if action == "finished":
            self.finished = True
            self.events.emit("finished", rounds=int(info.get("rounds", 0)))
        elif action != "identify":
            raise ConfigError(f"unknown query {action!r} from the coordinator")
        return RecordDict({records.INFO: ConfigRecord({"site": self.cfg.name})})


def _with_timing(update: SiteUpdate, train_s: float) -> SiteUpdate:
    return SiteUpdate(update.weights, update.num_samples, {**update.metrics, "train_s": float(train_s)})


def shareable_reason(exc: BaseException, site: str) -> str:
    """What the coordinator may learn about a failure at ``site`` (never a local path)."""
    if isinstance(exc, (AppNotApproved, *_SHAREABLE_ERRORS)):
        return str(exc)
    if isinstance(exc, CancelledError):
        return f"site {site} is shutting down"
    kind = "data" if isinstance(exc, DataError) else "configuration" if isinstance(exc, ConfigError) else "training"
    return f"{kind} problem at site {site} ({type(exc).__name__}); the site's own log has the details"


def build_client_app(worker: SiteWorker) -> ClientApp:
    """A Flower ``ClientApp`` whose handlers call ``worker``."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(worker.train(msg.content), reply_to=msg)

    @app.train("exchange")
    def exchange(msg: Message, context: Context) -> Message:
        return Message(answer_exchange(worker, msg.content), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(worker.query(msg.content), reply_to=msg)

    return app


def evaluate_at_site(worker: SiteWorker, content: RecordDict) -> RecordDict:
    """The site half: Dice of the received final models on the site's validation and testing sections."""
    ins = worker.addressed_instructions(content, "evaluation")
    method, spec = worker.method(ins.spec_json)
    values: dict[str, float] = {}
    if worker.validate:
        data = worker.data(spec.task, spec.image_size, spec.fundus_crop)
        names = {"global": "global", "personal": "personalized"}
        labels = list(method.task.label_names)
        for split_name, split in (("validation", data.validation), ("testing", data.test)):
            if not len(split.images):
                continue
            for key, weights in ins.instructions.weights.items():
                masks = segment_with(method.task, weights, split.images, worker.cfg.device)
                dice = dice_per_case(masks, split.masks, split.case_ids)
                model = names.get(key, key)
                values[f"{split_name}/{model}"] = float(np.mean(dice))
                for i, label in enumerate(labels):
                    values[f"{split_name}/{model}/{label}"] = float(np.mean(dice[:, i]))
        def means(split: str) -> dict[str, float]:
            return {k.split("/")[1]: round(v, 4) for k, v in values.items() if k.startswith(split + "/")
                    and k.count("/") == 1}

        worker.events.emit("metrics", round=ins.rounds, loss={}, dice=means("validation"),
                           test_dice=means("testing"), final=True)
    # the same two settings every reply carries (site, round): a site's answers have one shape
    return RecordDict({records.INFO: ConfigRecord({"site": worker.cfg.name, "round": int(ins.rounds)}),
                       records.METRICS: MetricRecord(values)})


__all__ = ["SiteWorker", "build_client_app", "shareable_reason"]
