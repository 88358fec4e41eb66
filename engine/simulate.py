"""``fedsm simulate``: run methods side by side on a (synthetic) multi-site federation.

Creates or reuses the data, runs each method through the in-process transport with the same
strategy code the network federation uses, evaluates every method on each site's test split,
and writes ``report.json``, ``report.md`` and the FedSM super model. The report schema is
documented in ``docs/report-schema.md``.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import catalogue
from engine.bundle import BundleMetadata, SuperModelBundle, save_bundle
from engine.bundle.single import single_model_bundle
from engine.bundle.split import SplitBundle, save_split_bundle
from engine.catalogue import build_method, method_names
from engine.data.site_data import SplitArrays, load_site
from engine.data.synth import DEFAULT_SLICES, existing_federation, generate_federation
from engine.errors import ConfigError, FedSMError
from engine.federation.exchange_ledger import LedgerWriter
from engine.federation.inprocess import run_exchange_rounds, run_rounds
from engine.fl.aggregation import check_lam
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.exchange import ExchangeMethod
from engine.fl.local_training import Device
from engine.fl.method_spec import TrainingSettings
from engine.fl.methods import FedSM, SiteRuntime
from engine.fl.methods.contract import NOISE_SEED_KEY, derived_seed
from engine.fl.model_selection import BestRoundKeeper, attach_best_round
from engine.fl.registry import EXCHANGE_METHODS, build_exchange_method
from engine.fl.robust import RobustSettings
from engine.fl.routing_choice import CHOICE_PART, choice_summary
from engine.fl.style_gate import GATE_PART, bundle_site_routing, gate_metadata
from engine.inference.guard import site_validation_from_state
from engine.inference.predictor import SuperModelPredictor
from engine.report import traffic_summary, write_reports
from engine.selector_report import SiteImages, selector_report
from engine.tasks import TaskSpec, get_task

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]

REPORT_SCHEMA = "fedsm-simulation-report/1"


@dataclass(frozen=True)
class SimulationConfig(TrainingSettings):
    """Everything that determines a simulation's result (recorded in the report).

    The hyper-parameters, their defaults and bounds are :class:`engine.fl.method_spec.TrainingSettings`'s,
    the same declaration a network run's signed spec uses; this class adds what only a simulation has
    (the sites' data, the methods side by side, the device, the coordinator's ``[robust]`` rules).
    """

    task: str = "fundus"
    sites: int = 3
    methods: tuple[str, ...] = ("fedavg", "fedsm")
    #: FedIOD (engine.fl.fediod): distillation steps per round, generated images per step,
    #: the teachers' epoch cap and early-stopping patience, and the privacy setting of sites
    #: (noise multiplier, or an epsilon target; clipping norm).
    fediod_steps: int = 100
    fediod_batch: int = 8
    teacher_epochs: int = 20
    teacher_patience: int = 4
    dp_noise: float = 0.0
    dp_epsilon: float | None = None
    dp_clip: float = 1.0
    device: str = "auto"
    data_dir: str | None = None
    #: Real site datalists, one per site (``fedsm simulate --data``); when given, ``sites`` is their
    #: count and no synthetic data is made.
    datalists: tuple[str, ...] = ()
    keep_best: bool = True
    holdout_site: str | None = None
    slices: int | None = None
    #: The coordinator's bounds on the sites' updates, as ``[robust]`` in federation.toml
    #: (:class:`engine.fl.robust.RobustSettings`): the simulation screens and aggregates as a network
    #: coordinator does.
    robust: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_task(self.task)
        self._check_training_settings()
        RobustSettings.from_dict(self.robust, "robust")  # checked now, not after the first method trained
        if self.datalists:
            object.__setattr__(self, "datalists", tuple(str(p) for p in self.datalists))
            object.__setattr__(self, "sites", len(self.datalists))
        object.__setattr__(self, "methods", tuple(self.methods))

        unknown = [m for m in self.methods if m not in method_names() and m not in EXCHANGE_METHODS]
        if unknown:
            raise ConfigError(f"unknown method(s) {unknown}; choose from "
                              f"{', '.join([*method_names(), *EXCHANGE_METHODS])}")
        if not self.methods:
            raise ConfigError("no methods given; e.g. --methods fedavg,fedsm")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be >= 1, got {self.rounds}")
        training_sites = self.sites - (1 if self.holdout_site else 0)
        if training_sites < 1:
            raise ConfigError("--holdout-site leaves no site to train on; use --sites 2 or more")
        self._resolve_run_defaults(self.task, training_sites)  # as a network run's spec does
        if {"fedsm", "fedsm-extra"} & set(self.methods):
            check_lam(self.lam, training_sites)
        broken = self.training_problems()  # the bounds a site would hold a network run to
        if broken:
            raise ConfigError("; ".join(broken))

    def training(self, method: str | None = None) -> Any:
        """Local training settings of ``method`` on this simulation's device (``None``: no method's
        exception; :meth:`TrainingSettings.local_training`)."""
        return self.local_training(method, self.device)


def prepare_data(cfg: SimulationConfig, out_dir: Path, progress: ProgressFn | None = None) -> list[Path]:
    """The sites' datalists: the real ones configured, else matching synthetic data reused or generated."""
    if cfg.datalists:
        log.info("training on %d site datalist(s): %s", len(cfg.datalists), ", ".join(cfg.datalists))
        return [Path(p) for p in cfg.datalists]
    data_dir = Path(cfg.data_dir) if cfg.data_dir else out_dir / "data"
    slices = cfg.slices or DEFAULT_SLICES
    found = existing_federation(data_dir, cfg.task, cfg.sites, cfg.image_size, cfg.seed, slices=slices)
    if found is not None:
        log.info("reusing synthetic data in %s", data_dir)
        return found
    log.info("writing synthetic %s data for %d sites to %s", cfg.task, cfg.sites, data_dir)
    if progress:
        progress({"event": "status", "message": f"generating synthetic {cfg.task} data in {data_dir}"})
    return generate_federation(cfg.task, cfg.sites, data_dir, image_size=cfg.image_size, seed=cfg.seed,
                               progress=(lambda msg: log.info(msg)), slices=slices)


def _label_means(dice: np.ndarray, labels: tuple[str, ...]) -> dict[str, float]:
    out = {name: float(dice[:, i].mean()) for i, name in enumerate(labels)}
    out["mean"] = float(dice.mean()) if dice.size else float("nan")
    return out


@dataclass
class MethodResult:
    """Evaluation of one method; serialised into ``report.json``."""

    dice: dict[str, dict[str, float]]
    client_average: dict[str, float]
    pooled: dict[str, float]
    wall_s: float
    rounds: list[dict[str, Any]]
    bytes_per_round: dict[str, dict[str, float]]
    extra: dict[str, Any] = field(default_factory=dict)
    #: Round whose weights were evaluated (best by validation Dice; the last round with ``keep_best`` off).
    best_round: int | None = None
    #: :meth:`engine.fl.model_selection.BestRoundKeeper.summary` (empty with ``keep_best`` off).
    model_selection: dict[str, Any] = field(default_factory=dict)


class Simulation:
    """One ``fedsm simulate`` run: data, methods, evaluation, report and super model."""

    def __init__(self, cfg: SimulationConfig, out_dir: Path, progress: ProgressFn | None = None,
                 cancel: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.progress = progress
        self.cancel = cancel
        self.task: TaskSpec = get_task(cfg.task)
        #: the coordinator's [robust] bounds, applied as over the network (engine.federation.inprocess)
        self.robust = RobustSettings.from_dict(cfg.robust, "robust")
        #: SoftPull's lam as FedSM uses it, recorded in the results and bundles (a study may train with
        #: a lam outside the product's [1/K, 1]: engine.bench.bench_simulation's lam sweep)
        self.lam_used: float | None = cfg.lam
        self.sites: list[Any] = []
        #: The site left out of training (``holdout_site``), evaluated as unseen; ``None`` without one.
        self.holdout: Any = None
        #: Optional ``hook(method, round, state, runtimes)`` called after every aggregation (the
        #: benchmarks record per-round curves with it); ``None`` leaves every run untouched.
        self.round_hook: Callable[[Any, int, dict[str, Any], list[Any]], None] | None = None
        #: The best-round keeper of the last method run (``None`` with ``keep_best`` off).
        self.last_keeper: Any = None

    # --- data ----------------------------------------------------------------------------
    def load_sites(self) -> None:
        datalists = prepare_data(self.cfg, self.out_dir, self.progress)
        self.sites = [load_site(p, self.task, self.cfg.image_size, fundus_crop=self.cfg.fundus_crop)
                      for p in datalists]
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            raise ConfigError(f"site names must be unique, got {names}")
        if self.cfg.holdout_site is not None:
            if self.cfg.holdout_site not in names:
                raise ConfigError(f"--holdout-site {self.cfg.holdout_site!r} is not a site of this federation; "
                                  f"choose one of {', '.join(names)}")
            self.holdout = self.sites.pop(names.index(self.cfg.holdout_site))

    def _runtimes(self) -> list[Any]:
        return [SiteRuntime(s.name, i, s.train, validation=s.validation) for i, s in enumerate(self.sites)]

    def _pooled_runtime(self) -> Any:
        parts = [s.train for s in self.sites]
        offsets = np.cumsum([0] + [int(p.case_ids.max(initial=-1)) + 1 for p in parts])
        pooled = SplitArrays(np.concatenate([p.images for p in parts]), np.concatenate([p.masks for p in parts]),
                             np.concatenate([p.case_ids + o for p, o in zip(parts, offsets, strict=False)]))
        return SiteRuntime("pooled", 0, pooled)

    # --- evaluation ----------------------------------------------------------------------
    def _evaluate(self, predict: Callable[[int, np.ndarray], np.ndarray]) -> tuple[dict, dict, dict]:
        """Dice per site, client average and pooled, with ``predict(site_index, images)``."""
        labels = self.task.label_names
        per_site: dict[str, dict[str, float]] = {}
        all_cases = []
        for k, site in enumerate(self.sites):
            test = site.test
            masks = predict(k, test.images)
            dice = dice_per_case(masks, test.masks, test.case_ids)
            per_site[site.name] = _label_means(dice, labels)
            all_cases.append(dice)
        client_avg = {key: float(np.mean([d[key] for d in per_site.values()])) for key in [*labels, "mean"]}
        pooled = _label_means(np.concatenate(all_cases), labels)
        return per_site, client_avg, pooled

    def _round_summaries(self, records: list[Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
        # ``direction``: each site's cosine against the others' median, where the robust aggregation read it, with
        # the sites' median change size and whether the round counted as evidence (engine.fl.robust.DirectionMemory)
        keys = ("direction", "direction_size", "direction_judged")
        rounds = [{"round": r.round, "answered": r.answered, "failed": r.failed, "wall_s": round(r.wall_s, 3),
                   "metrics": r.metrics, **{key: getattr(r, key) for key in keys if getattr(r, key, None)}}
                  for r in records]
        per_site: dict[str, dict[str, float]] = {}
        for s in self.sites:
            to_site = [r.bytes_to_site.get(s.name, 0) for r in records]
            from_site = [r.bytes_from_site.get(s.name, 0) for r in records]
            per_site[s.name] = {"received_mean": float(np.mean(to_site)) if to_site else 0.0,
                                "sent_mean": float(np.mean(from_site)) if from_site else 0.0,
                                "received_total": float(sum(to_site)), "sent_total": float(sum(from_site))}
        return rounds, per_site

    # --- methods -------------------------------------------------------------------------
    def _build_method(self, name: str) -> Any:
        training = self.cfg.training(name)
        return build_method(name, self.task, [s.name for s in self.sites], training, self.cfg.seed, self.cfg.rounds,
                            self.cfg)

    def run_method(self, name: str) -> MethodResult:
        """Train and evaluate one method."""
        if name in EXCHANGE_METHODS:
            return self.run_exchange_method(name)
        start = time.perf_counter()
        training = self.cfg.training()
        extra: dict[str, Any] = {}
        # Centralized: the method trained on every site's data as one site (benchmark variants such as
        # fedsm-apfl are not catalogue names; their Simulation subclass builds them)
        if name in catalogue.method_names() and catalogue.method(name).pooled:
            method = build_method(name, self.task, ["pooled"], training, self.cfg.seed, self.cfg.rounds, self.cfg)
            method.name = name  # type: ignore[misc]
            pooled_runtime = self._pooled_runtime()
            self._attach_round_hook(method, [pooled_runtime])
            keeper = self._attach_best_round(method, [pooled_runtime])
            state, records = run_rounds(method, [pooled_runtime], self.cfg.rounds,
                                        progress=self.progress, cancel=self.cancel, robust=self.robust)
            weights = state["global"]
            per_site, client_avg, pooled = self._evaluate(
                lambda k, x: segment_with(self.task, weights, x, self.cfg.device))
            rounds, _ = self._round_summaries(records)
            zero = {"received_mean": 0.0, "sent_mean": 0.0, "received_total": 0.0, "sent_total": 0.0}
            local_ood = self.cross_site_dice(lambda k, x: segment_with(self.task, weights, x, self.cfg.device),
                                             shared=True)
            return MethodResult(per_site, client_avg, pooled, time.perf_counter() - start, rounds,
                                {s.name: dict(zero) for s in self.sites},
                                {**self._unseen_dice(weights), "local_ood": local_ood},
                                **self._selection(keeper, method))

        method = self._build_method(name)
        runtimes = self._runtimes()
        self._attach_round_hook(method, runtimes)
        keeper = self._attach_best_round(method, runtimes)
        state, records = run_rounds(method, runtimes, method.total_rounds, progress=self.progress,
                                    cancel=self.cancel, robust=self.robust)
        if name == "local":
            models = [rt.state["local_model"] for rt in runtimes]
            per_site, client_avg, pooled = self._evaluate(
                lambda k, x: segment_with(self.task, models[k], x, self.cfg.device))
            extra["cross_site"] = self._cross_site(models)
            extra["local_ood"] = self.cross_site_dice(
                lambda k, x: segment_with(self.task, models[k], x, self.cfg.device))
        elif name in ("fedsm", "fedsm-extra") or isinstance(method, FedSM):
            per_site, client_avg, pooled, extra = self._evaluate_supermodel(method, state, records)
        else:
            per_site, client_avg, pooled = self._evaluate(
                lambda k, x: segment_with(self.task, state["global"], x, self.cfg.device))
            extra["bundle"] = self._single_model_bundle(name, state["global"], method.total_rounds)
            extra["local_ood"] = self.cross_site_dice(
                lambda k, x: segment_with(self.task, state["global"], x, self.cfg.device), shared=True)
            extra |= self._unseen_dice(state["global"])
        rounds, bytes_per_round = self._round_summaries(records)
        return MethodResult(per_site, client_avg, pooled, time.perf_counter() - start, rounds, bytes_per_round,
                            extra, **self._selection(keeper, method))

    def _attach_best_round(self, method: Any, runtimes: list[Any]) -> Any:
        """With ``keep_best``: a :class:`~engine.fl.model_selection.BestRoundKeeper` on ``method`` (else ``None``)."""
        if not self.cfg.keep_best:
            return None
        keeper = BestRoundKeeper(self.task, self.sites, self.cfg.device)
        attach_best_round(method, runtimes, keeper)
        self.last_keeper = keeper
        return keeper

    @staticmethod
    def _selection(keeper: Any, method: Any) -> dict[str, Any]:
        if keeper is None:
            return {"best_round": method.rounds, "model_selection": {}}
        summary = keeper.summary()
        return {"best_round": summary.get("best_round"), "model_selection": summary}

    def _cross_site(self, models: list[Any]) -> dict[str, Any]:
        """Local baseline scored as the paper scores it: every site's model on *every* site's test data.

        ``per_model[site]`` is that site's model's client average over all sites; ``client_average``
        and ``pooled`` average those over the models (the own-site scores stay in the main result).
        """
        per_model: dict[str, dict[str, float]] = {}
        pooled: list[dict[str, float]] = []
        for j, site in enumerate(self.sites):
            _, avg, pool = self._evaluate(lambda k, x, j=j: segment_with(self.task, models[j], x, self.cfg.device))
            per_model[site.name] = avg
            pooled.append(pool)
        keys = [*self.task.label_names, "mean"]
        return {"per_model": per_model,
                "client_average": {k: float(np.mean([v[k] for v in per_model.values()])) for k in keys},
                "pooled": {k: float(np.mean([v[k] for v in pooled])) for k in keys}}

    def run_exchange_method(self, name: str) -> MethodResult:
        """Train and evaluate a dialogue method (:mod:`engine.fl.exchange`) through the in-process transport.

        The method's own :meth:`~engine.fl.exchange.ExchangeMethod.segmenter` says how each
        site segments with the result; ``report_extra(state, runtimes)`` (when the method has
        it) adds method-specific results, and a ``"bundle"`` among them is saved with the report.
        """
        start = time.perf_counter()
        settings = asdict(self.cfg)
        settings |= settings.pop("options")
        method = build_exchange_method(name, self.task, [s.name for s in self.sites], settings)
        runtimes = self._runtimes()
        for runtime in runtimes:  # privacy noise seeded from the run's seed, so that a simulation repeats; a
            # network site draws it from the OS's secure generator (engine.fl.methods.contract.NOISE_SEED_KEY)
            runtime.state[NOISE_SEED_KEY] = derived_seed(self.cfg.seed, "dp-noise", runtime.name)
        self._attach_round_hook(method, runtimes)
        ledger = LedgerWriter(method, self.out_dir / f"{name}-ledger.jsonl")  # what every exchange carried
        try:
            state, records = run_exchange_rounds(method, runtimes, method.total_rounds, progress=self.progress,
                                                 cancel=self.cancel, recorder=ledger)
        finally:
            ledger.close()
        predict = method.segmenter(state, runtimes, self.cfg.device)
        per_site, client_avg, pooled = self._evaluate(predict)
        report_extra = getattr(method, "report_extra", None)
        extra = report_extra(state, runtimes) if report_extra is not None else {}
        extra["local_ood"] = self.cross_site_dice(predict)
        site_segmenters = getattr(method, "site_segmenters", None)
        if site_segmenters is not None:
            extra["standalone"] = self._evaluate_site_models(site_segmenters(runtimes, self.cfg.device))
        make_bundle = getattr(method, "bundle", None)
        if make_bundle is not None:
            val_dice = {s.name: (float(dice_per_case(predict(k, s.validation.images), s.validation.masks,
                                                     s.validation.case_ids).mean())
                                 if len(s.validation.images) else None) for k, s in enumerate(self.sites)}
            extra["bundle"] = make_bundle(state, {"seed": self.cfg.seed}, val_dice)
        rounds, bytes_per_round = self._round_summaries(records)
        # no best-round selection for dialogue methods: the last round is evaluated
        return MethodResult(per_site, client_avg, pooled, time.perf_counter() - start, rounds, bytes_per_round,
                            extra, best_round=method.total_rounds)

    def cross_site_dice(self, predict: Callable[[int, np.ndarray], np.ndarray],
                        shared: bool = False) -> dict[str, dict[str, float]]:
        """Per site ``k``: mean Dice on its own test set (``local``) and the mean over the other sites' (``ood``).

        ``predict(k, images)`` segments as site ``k`` would (its own client net or model), so
        ``ood`` says how site ``k``'s model does on data from elsewhere (BlackFed's Tables 2-3).
        ``shared``: every site uses the same model (FedAvg's global), so each test set is segmented once.
        """
        cache: dict[int, float] = {}

        def score(k: int, j: int) -> float:
            if shared and j in cache:
                return cache[j]
            test = self.sites[j].test
            cache[j] = float(dice_per_case(predict(k, test.images), test.masks, test.case_ids).mean())
            return cache[j]

        out: dict[str, dict[str, float]] = {}
        for k, site in enumerate(self.sites):
            scores = [score(k, j) for j in range(len(self.sites))]
            others = [s for j, s in enumerate(scores) if j != k]
            out[site.name] = {"local": scores[k], "ood": float(np.mean(others)) if others else float("nan")}
        return out

    def _evaluate_site_models(self, models: dict[str, Callable[[np.ndarray], np.ndarray]]) -> dict[str, Any]:
        """Each site's own model on every site's test split ("Standalone"): per model, and mean +- std."""
        per_model = {}
        for name, predict in models.items():
            per_site, client_avg, pooled = self._evaluate(lambda k, x, predict=predict: predict(x))
            per_model[name] = {"dice": per_site, "client_average": client_avg, "pooled": pooled}
        keys = [*self.task.label_names, "mean"]
        avgs = [m["client_average"] for m in per_model.values()]
        return {"models": per_model,
                "mean": {k: float(np.mean([a[k] for a in avgs])) for k in keys} if avgs else {},
                "std": {k: float(np.std([a[k] for a in avgs])) for k in keys} if avgs else {}}

    def _attach_round_hook(self, method: Any, runtimes: list[Any]) -> None:
        """Call :attr:`round_hook` after each of ``method``'s aggregations (no-op without a hook)."""
        hook = self.round_hook
        if hook is None:
            return
        if isinstance(method, ExchangeMethod):
            dialogue = method.dialogue

            def dialogue_and_report(state: dict[str, Any], rnd: int) -> Any:
                new = yield from dialogue(state, rnd)
                hook(method, rnd, new, runtimes)
                return new

            method.dialogue = dialogue_and_report  # type: ignore[method-assign]
            return
        aggregate = method.aggregate

        def aggregate_and_report(state: dict[str, Any], rnd: int, updates: Any) -> dict[str, Any]:
            new = aggregate(state, rnd, updates)
            hook(method, rnd, new, runtimes)
            return new

        method.aggregate = aggregate_and_report

    def _bundle(self, method: Any, state: dict[str, Any], val_dice: dict[str, float | None]) -> Any:
        extra_method = method.name == "fedsm-extra"
        guarded = not extra_method and "validation_dice" in state
        details: dict[str, Any] = {"seed": self.cfg.seed, "fundus_crop": self.cfg.fundus_crop,
                                   "selector_calibration": getattr(method, "selector_calibration", "lda")}
        if "selector_calibration" in state:
            details["selector_temperature"] = float(state["selector_calibration"]["temperature"][0])
        if "selector_gamma" in state:  # --gamma auto: the federation's choice and what it rests on
            details["gamma_choice"] = {k: float(v[0]) for k, v in state["selector_gamma"].items()}
        if CHOICE_PART in state:  # site_routing auto: the rule kept and the validation shares it rests on
            details["routing_choice"] = choice_summary(state[CHOICE_PART])
        routing_gamma = getattr(method, "routing_gamma", None)
        gate = {} if extra_method else gate_metadata(state.get(GATE_PART, {}), [s.name for s in self.sites])
        meta = BundleMetadata(
            task=self.task.name, label_names=list(self.task.label_names), in_channels=self.task.in_channels,
            image_size=self.cfg.image_size, selector_size=self.cfg.selector_size,
            selector_head=self.cfg.selector_head, selector_width=self.cfg.selector_width,
            normalisation=self.task.normalisation,
            site_names=[s.name for s in self.sites], method=method.name,
            routing="argmax" if extra_method else "gamma", lam=float(self.lam_used or 0.0),
            personalization=getattr(method, "personalization", "softpull"),
            gamma=float(routing_gamma(state)) if routing_gamma is not None and not extra_method
            else self.cfg.fixed_gamma,
            rounds=method.total_rounds, val_dice=val_dice,
            site_validation=site_validation_from_state(state, [s.name for s in self.sites]) if guarded else {},
            routing_guard=bool(self.cfg.routing_guard) and guarded,
            style_gate=gate, site_routing=bundle_site_routing(self.cfg.site_routing, gate, state.get(CHOICE_PART)),
            extra=details)
        return SuperModelBundle(meta, state["global"], {s.name: state[f"personal/{s.name}"] for s in self.sites},
                                state["selector"])

    def _single_model_bundle(self, name: str, weights: Any, rounds: int) -> Any:
        """FedAvg/FedProx/Scaffold's global model as a single-model bundle, with its per-site validation Dice."""
        val_dice: dict[str, float | None] = {}
        for site in self.sites:
            v = site.validation
            value = (float(dice_per_case(segment_with(self.task, weights, v.images, self.cfg.device),
                                         v.masks, v.case_ids).mean()) if len(v.images) else None)
            val_dice[site.name] = value if value is not None and np.isfinite(value) else None
        return single_model_bundle(self.task.name, name, weights, [s.name for s in self.sites], self.cfg.image_size,
                                   rounds=rounds, val_dice=val_dice,
                                   extra={"seed": self.cfg.seed, "trained_by": "fedsm simulate",
                                          "fundus_crop": self.cfg.fundus_crop})

    def _evaluate_supermodel(self, method: Any, state: dict[str, Any],
                             records: list[Any]) -> tuple[dict, dict, dict, dict[str, Any]]:
        names = [s.name for s in self.sites]
        predictor = SuperModelPredictor(self._bundle(method, state, {n: None for n in names}), self.cfg.device)

        # validation Dice of the routed super model, recorded in the bundle for the clinician
        val_dice: dict[str, float | None] = {}
        for site in self.sites:
            if len(site.validation.images):
                pred = predictor.predict(site.validation.images, cases=site.validation.case_ids)
                val_dice[site.name] = float(dice_per_case(pred.masks, site.validation.masks,
                                                          site.validation.case_ids).mean())
            else:
                val_dice[site.name] = None
        bundle = self._bundle(method, state, val_dice)
        # the same networks and routing settings (both bundles come from ``state``): only the validation Dice
        # recorded for the clinician differs, which routing does not read; building the predictor again cost
        # K + 2 networks per evaluation
        predictor.metadata = bundle.metadata

        routing: dict[str, dict[str, float]] = {}
        preds: dict[int, Any] = {}
        for k, site in enumerate(self.sites):
            pred = predictor.predict(site.test.images, cases=site.test.case_ids)
            preds[k] = pred
            chosen = pred.routed_names(names)
            routing[site.name] = {m: chosen.count(m) / max(len(chosen), 1) for m in ["global", *names]}
        per_site, client_avg, pooled = self._evaluate(lambda k, x: preds[k].masks)

        # selector accuracy at telling participating sites' held-out images apart
        held_out_acc: dict[str, float] = {}
        hits = total = 0
        for k, site in enumerate(self.sites):
            images = np.concatenate([site.validation.images, site.test.images])
            pred = predictor.predict(images) if len(images) else None
            if pred is None:
                continue
            site_probs = pred.probabilities[:, 1:] if method.name == "fedsm-extra" else pred.probabilities
            correct = int((site_probs.argmax(1) == k).sum())
            held_out_acc[site.name] = correct / len(images)
            hits += correct
            total += len(images)
        held_out_acc["overall"] = hits / max(total, 1)

        # components: the global model alone and each site's own personalized model (oracle routing)
        glob = self._evaluate(lambda k, x: segment_with(self.task, state["global"], x, self.cfg.device))
        oracle = self._evaluate(
            lambda k, x: segment_with(self.task, state[f"personal/{names[k]}"], x, self.cfg.device))
        extra = {
            "selector_accuracy": held_out_acc,
            **({"selector": self._selector_analysis(predictor)} if method.name == "fedsm" else {}),
            "routing": routing,
            "gamma": float(predictor.metadata.gamma),  # the federation's choice with --gamma auto
            "lam": self.lam_used,
            "val_dice": val_dice,
            "components": {"global_only": {"client_average": glob[1], "pooled": glob[2], "per_site": glob[0]},
                           "personal_oracle": {"client_average": oracle[1], "pooled": oracle[2],
                                               "per_site": oracle[0]}},
            "personalization": getattr(method, "personalization", "softpull"),
            "bundle": bundle,
        }
        return per_site, client_avg, pooled, extra

    def _unseen_images(self) -> Any:
        """All images of the held-out site (every split is unseen), ``None`` without one."""
        if self.holdout is None:
            return None
        parts = [self.holdout.train, self.holdout.validation, self.holdout.test]
        offsets = np.cumsum([0] + [int(p.case_ids.max(initial=-1)) + 1 for p in parts])
        return SiteImages(self.holdout.name, np.concatenate([p.images for p in parts]),
                          np.concatenate([p.masks for p in parts]),
                          np.concatenate([p.case_ids + o for p, o in zip(parts, offsets, strict=False)]))

    def _selector_analysis(self, predictor: Any) -> dict[str, Any]:
        """Selector confidence, calibration, routing per gamma and guard on/off Dice (:mod:`engine.selector_report`)."""
        seen = [SiteImages(s.name, s.test.images, s.test.masks, s.test.case_ids) for s in self.sites]
        return selector_report(predictor, seen, self._unseen_images(), predictor.metadata.gamma)

    def _unseen_dice(self, weights: Any) -> dict[str, Any]:
        """Dice of one model on the held-out site (``{}`` without one)."""
        unseen = self._unseen_images()
        if unseen is None:
            return {}
        masks = segment_with(self.task, weights, unseen.images, self.cfg.device)
        return {"unseen": {"site": unseen.name,
                           "dice": float(dice_per_case(masks, unseen.masks, unseen.case_ids).mean())}}

    # --- whole run -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run every configured method and write the report files and super model."""
        started = time.perf_counter()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.load_sites()
        results: dict[str, MethodResult] = {}
        bundles: dict[str, Any] = {}

        order = [m for m in method_names() if m in self.cfg.methods]
        order += [m for m in self.cfg.methods if m in EXCHANGE_METHODS and m not in order]
        for name in order:
            log.info("method %s: %d rounds over %d sites", name, self.cfg.rounds, len(self.sites))
            if self.progress:
                self.progress({"event": "method_start", "method": name})
            result = self.run_method(name)
            bundle = result.extra.pop("bundle", None)
            if bundle is not None:
                bundles[name] = bundle
            results[name] = result
            if self.progress:
                self.progress({"event": "method_end", "method": name, "client_average": result.client_average,
                               "wall_s": round(result.wall_s, 2)})
        supermodel: dict[str, Any] = {}
        global_models: dict[str, Any] = {}
        failed: list[str] = []
        # FedSM's super models under their historic names; FedAvg, FedProx, Scaffold (and the other
        # methods with a bundle) as a single-model bundle <method>.safetensors.
        files = {"fedsm": "supermodel.safetensors", "fedsm-extra": "supermodel-extra.safetensors"}
        for name, bundle in bundles.items():
            file = files.get(name, f"{name}.safetensors")
            entries = supermodel if name in files else global_models
            path = self.out_dir / file
            try:
                digest = _save_any_bundle(path, bundle)
                entries[name] = {"path": file, "sha256": digest, "bytes": path.stat().st_size}
            except Exception as exc:  # a full disk or a failing write: the report is still written
                reason = _write_failure(exc)
                entries[name] = {"path": None, "error": f"could not write {file}: {reason}"}
                failed.append(f"{file} ({reason})")
        report = {
            "schema": REPORT_SCHEMA,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "config": {**asdict(self.cfg), "methods": list(self.cfg.methods), "lam": self.lam_used},
            "machine": _machine_info(self.cfg.device),
            "task": {"name": self.task.name, "label_names": list(self.task.label_names)},
            "sites": [_site_summary(s) for s in self.sites],
            "holdout_site": _site_summary(self.holdout) if self.holdout is not None else None,
            "methods": {name: asdict(r) for name, r in results.items()},
            "supermodel": supermodel,
            "global_models": global_models,
            "traffic": traffic_summary(self.task, self.cfg, len(self.sites), results),
            "wall_s": round(time.perf_counter() - started, 2),
        }
        try:
            write_reports(self.out_dir, report)
        except Exception as exc:
            raise FedSMError(f"training finished, but the report could not be written to {self.out_dir} "
                             f"({_write_failure(exc)})" + (f"; nor could {', '.join(failed)}" if failed else "")
                             + "; free disk space or choose another --out and run again") from None
        if failed:
            raise FedSMError(f"training finished and the report was written to {self.out_dir}, but "
                             f"{', '.join(failed)} could not be written; free disk space or choose another --out "
                             "and run again")
        return report


def _write_failure(exc: BaseException) -> str:
    """What went wrong with a file write, in one line (OSError's strerror, else the message)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"


def _save_any_bundle(path: Path, bundle: Any) -> str:
    """Save a super model, single-model bundle, or a dialogue method's split-network bundle (BlackFed)."""
    if isinstance(bundle, SplitBundle):
        return save_split_bundle(path, bundle)
    return save_bundle(path, bundle)


def _site_summary(site: Any) -> dict[str, Any]:
    def split(s: Any) -> dict[str, int]:
        return {"cases": len(np.unique(s.case_ids)), "images": len(s.images)}

    return {"name": site.name, "train": split(site.train), "validation": split(site.validation),
            "test": split(site.test)}


def _machine_info(device: str) -> dict[str, Any]:
    dev = Device.resolve(device)
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": str(dev.torch_device), "mixed_precision": dev.amp,
            "gpu": torch.cuda.get_device_name(0) if dev.torch_device.type == "cuda" else None}


def run_simulation(cfg: SimulationConfig, out_dir: Path, progress: ProgressFn | None = None,
                   cancel: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Run a simulation and return its report (also written to ``out_dir``)."""
    return Simulation(replace(cfg), out_dir, progress, cancel).run()
