"""FedSM (Xu et al., CVPR 2022) and FedSM-extra: a global model, personalized models and a model selector."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.errors import ConfigError, WeightsError
from engine.fl.aggregation import check_lam, fedavg, soft_pull
from engine.fl.evaluation import dice_per_case, segment_with
from engine.fl.local_training import (
    Device,
    LocalTrainingConfig,
    RoundContext,
    best_model_labels,
    selector_inputs,
    train_fedsm_round,
    train_segmentation_round,
    train_selector_round,
)
from engine.fl.methods.contract import (
    OPTIM_PART,
    FederatedMethod,
    SiteInstructions,
    SiteRuntime,
    SiteUpdate,
    WeightSet,
    derived_seed,
)
from engine.fl.personalization import (
    SHARED_TRACK_RULES,
    SOFTPULL,
    PersonalizationConfig,
    apfl_model_now,
    check_personalization,
    personalized_model,
    shared_model_update,
    train_personalized_round,
)
from engine.fl.routing_choice import (
    AUTO,
    CHOICE_PART,
    ROUTING_PART,
    check_routing_statistics,
    choose_site_routing,
    selector_own_share,
    style_routing_statistics,
)
from engine.fl.selector_calibration import (
    STAT_KEYS,
    add_statistics,
    calibrated_selector,
    class_statistics,
    final_layer_keys,
    penultimate_features,
)
from engine.fl.selector_gamma import check_histogram_statistics, check_pass_fraction, choose_gamma, histogram_statistics
from engine.fl.selector_schemes import check_calibration
from engine.fl.selector_training import (
    TEMPERATURE_GRID,
    apply_temperature,
    check_temperature_statistics,
    fit_temperature,
    initial_optimizer_state,
    reference_selector_round,
    selector_logits,
    temperature_statistics,
)
from engine.fl.style_gate import (
    GATE_PART,
    HIST_PART,
    SITE_GATE_KEYS,
    STATS_PART,
    calibration_distances,
    check_distance_histogram,
    check_site_routing,
    check_style_statistics,
    distance_histogram,
    fit_style_gate,
    nearest_sites,
    style_descriptors,
    style_distance_matrix,
    style_statistics,
    threshold_from_histograms,
)
from engine.fl.weights import Weights, all_finite, check_compatible
from engine.models import build_selector
from engine.models.style_gate_format import check_quantile
from engine.tasks import TaskSpec

if TYPE_CHECKING:
    pass


#: Payload part of a site's temperature statistics (last round, ``selector_calibration="temperature"``).
TEMPERATURE_PART = "selector_temperature"
#: Payload part of a site's own-site confidence histogram (last round, ``gamma_pass`` set: ``--gamma auto``).
GAMMA_PART = "selector_gamma"
#: What a FedSM site reports of its validation data in the last round: server-state key -> metric.
VALIDATION_METRICS = {"global": "val_dice_global", "personal": "val_dice_personal",
                      "diff_sd": "val_dice_diff_sd", "cases": "val_cases"}
#: Parts a FedSM site's last-round answer may hold (besides the style gate's histogram).
LAST_ROUND_PARTS = frozenset({"selector_stats", TEMPERATURE_PART, GAMMA_PART, ROUTING_PART})

log = logging.getLogger(__name__)


class FedSM(FederatedMethod):
    """FedSM (Xu et al., CVPR 2022): global model, SoftPull personalized models, model selector.

    Rounds ``1..rounds`` are the paper's Algorithm 1. The selector is trained as the paper's
    reference trains it (:mod:`engine.fl.selector_training`): per round, one Adam step per site
    from the cross-entropy gradient summed over its local pass, the Adam moments averaged on
    the server with the weights (server state ``"selector_optim"``). One more round finishes the
    super model: every site evaluates the final global model and its final personalized model
    on its validation images and reports both Dice values (metrics ``val_dice_global`` and
    ``val_dice_personal``; the server keeps them in state ``"validation_dice"`` for the routing
    guard, :mod:`engine.inference.guard`), and, depending on ``selector_calibration``, sends
    selector statistics:

    - ``"none"`` (default): nothing more;
    - ``"temperature"``: NLL sums per grid temperature on its validation images; the server
      folds the best temperature into the selector's last layer;
    - ``"lda"``: the older scheme. The selector takes a step per batch (the caller gives it a
      small lr, 1e-5), and the last round sends class feature statistics from which the server
      fits the last layer by LDA (:mod:`engine.fl.selector_calibration`). Measured failure: its
      posteriors are ~1.0 on seen AND unseen sites, so gamma cannot send unseen images to the
      global model (``docs/architecture.md``).

    Parameters
    ----------
    lam
        SoftPull coefficient in ``[1/K, 1]``; ``K`` is the number of configured sites for this
        check, while each round's SoftPull pulls among the sites that answered.
    gamma
        Routing threshold recorded for inference (Algorithm 2, strict ``>``).
    selector_calibration
        ``"none"``, ``"temperature"`` or ``"lda"`` (see above).
    selector_warmup
        Selector-only rounds before Algorithm 1 (reference scheme only): the selector gets one
        Adam step per round, so short runs (tens of rounds, where the paper trains hundreds)
        give it more steps this way at a fraction of a full round's cost; the segmentation
        models are neither sent nor trained in them. 0 (default) is the paper's schedule.
    gamma_pass
        ``None`` (default): route with ``gamma``. A fraction in (0, 1] (``--gamma auto``): the last
        round chooses gamma from the sites' histograms of validation confidence so that this share
        of the validation images the selector recognises passes it (:mod:`engine.fl.selector_gamma`);
        the server keeps it in state ``"selector_gamma"`` and :meth:`routing_gamma` returns it.
    style_gate
        ``None`` (off): route by the selector alone. A quantile in (0, 1]: the site-style gate
        (:mod:`engine.fl.style_gate`). Every training and warm-up round each site also sends its
        training images' descriptor sums (part ``"style_stats"``; the server keeps the latest per
        site in state ``"style_stats"`` and refits state ``"style_gate"``); the last round sends a
        histogram of its validation images' distances (part ``"style_hist"``), from which the
        server sets the gate's threshold at this quantile. Images beyond it go to the global model.
    site_routing
        ``"auto"`` (default), ``"selector"`` or ``"style"``: how the super model picks an image's
        site (:mod:`engine.fl.routing_choice`). With ``"auto"``, the gate on and the reference
        selector, the last round also sends the selector's own-site confidence histogram (part
        ``"selector_gamma"``) and the style rule's counts (part ``"routing_stats"``); the server
        keeps the rule that sends more validation images to their own site's model (state
        ``"site_routing_choice"``). Without the gate, or with ``lda``, ``"auto"`` is the selector.
    personalization
        How the personalized models train (:mod:`engine.fl.personalization`): ``"softpull"``
        (the paper's; server state ``"personal/<site>"`` every round) or ``"finetune"``,
        ``"apfl"``, ``"perfedavg"``, ``"pfedme"`` (the paper's Table 6). Everything else is the
        same for every rule: the global model, the selector, the gate, the routing choice, the
        routing guard and the bundle. With another rule a site keeps its private state (APFL's
        ``v`` and ``alpha``, pFedMe's ``theta``) and sends its personalized model once, with its
        last-round answer (part ``"personal"``, validated like the global model), which also
        carries that model's validation Dice for the guard. Per-FedAvg and pFedMe train one more
        shared U-Net (server state ``"shared"``, sent and averaged every round).
    personalization_config
        The rules' hyper-parameters (:class:`engine.fl.personalization.PersonalizationConfig`).
    """

    name = "fedsm"

    @classmethod
    def from_settings(cls, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig, seed: int,
                      rounds: int, settings: Any) -> FedSM:
        auto = settings.gamma == "auto"  # the federation chooses gamma; fixed_gamma is only the fallback
        return cls(task, site_names, training, seed, rounds, lam=float(settings.lam or 0),
                   gamma=settings.fixed_gamma, selector_calibration=settings.selector_calibration,
                   selector_warmup=int(settings.selector_warmup), gamma_pass=settings.gamma_pass if auto else None,
                   style_gate=settings.style_gate, site_routing=settings.site_routing,
                   personalization=settings.personalization)

    def __init__(self, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig,
                 seed: int = 0, rounds: int = 1, lam: float = 0.7, gamma: float = 0.6,
                 selector_calibration: str = "none", selector_warmup: int = 0,
                 gamma_pass: float | None = None, style_gate: float | None = None,
                 site_routing: str = AUTO, personalization: str = SOFTPULL,
                 personalization_config: PersonalizationConfig | None = None) -> None:
        super().__init__(task, site_names, training, seed, rounds)
        check_lam(lam, len(site_names))
        self.personalization = check_personalization(personalization)
        self.pcfg = personalization_config or PersonalizationConfig()
        if not 0.0 <= gamma <= 1.0:
            raise ConfigError(f"gamma={gamma} must lie in [0, 1]")
        self.lam = lam
        self.gamma = gamma
        self.selector_calibration = check_calibration(selector_calibration)
        if isinstance(selector_warmup, bool) or not isinstance(selector_warmup, int) or selector_warmup < 0:
            raise ConfigError(f"selector_warmup must be a whole number >= 0, got {selector_warmup!r}")
        if selector_warmup and not self.reference_selector:
            raise ConfigError("selector warm-up rounds need the reference selector; drop --selector-warmup or "
                              "choose --selector-calibration none or temperature")
        self.selector_warmup = selector_warmup
        if gamma_pass is not None and not self.reference_selector:
            raise ConfigError("--gamma auto needs the reference selector (its last layer is final before the "
                              "last round); choose --selector-calibration none or temperature, or a number for --gamma")
        self.gamma_pass = None if gamma_pass is None else check_pass_fraction(gamma_pass)
        self.style_quantile = None if style_gate is None else check_quantile(style_gate)
        self.site_routing = check_site_routing(site_routing, self.style_quantile)

    def wire_parts(self, rnd: int) -> frozenset[str]:
        """None in the last round: the sites score, and calibrate on, exactly the models the bundle keeps."""
        return frozenset() if self.phase(rnd) == "calibrate" else super().wire_parts(rnd)

    @property
    def compares_routings(self) -> bool:
        """Whether the last round measures the selector against style routing (``site_routing="auto"``)."""
        return self.site_routing == AUTO and self.style_quantile is not None and self.reference_selector

    def routing_gamma(self, state: Mapping[str, Weights]) -> float:
        """The gamma the super model routes with: the federation's choice when ``gamma_pass`` is set."""
        if self.gamma_pass is not None and GAMMA_PART in state:
            return float(state[GAMMA_PART]["gamma"][0])
        return float(self.gamma)

    @property
    def reference_selector(self) -> bool:
        """Whether the selector trains with the reference scheme (all calibrations but ``lda``)."""
        return self.selector_calibration != "lda"

    @property
    def num_selector_classes(self) -> int:
        return len(self.site_names)

    @property
    def total_rounds(self) -> int:
        return self.selector_warmup + self.rounds + 1

    @property
    def last_training_round(self) -> int:
        """The last round of Algorithm 1 (after the selector warm-up rounds)."""
        return self.selector_warmup + self.rounds

    def phase(self, rnd: int) -> str:
        """``"selector"`` (warm-up), ``"train"`` (Algorithm 1) or ``"calibrate"`` (validation Dice and
        selector statistics, last round)."""
        if rnd == self.total_rounds:
            return "calibrate"
        return "selector" if rnd <= self.selector_warmup else "train"

    @property
    def softpull(self) -> bool:
        """Whether the personalized models train with SoftPull (server state ``personal/<site>``)."""
        return self.personalization == SOFTPULL

    def personal_model_now(self, received: Mapping[str, Any], site_state: Mapping[str, Any]) -> Any | None:
        """A site's personalized model during training, for its per-round scores: the one it received
        (SoftPull), APFL's mix of its private model with the received global model, or ``None`` where
        the rule builds it only in the last round."""
        if "personal" in received:
            return received["personal"]
        if self.personalization == "apfl" and "global" in received:
            return apfl_model_now(site_state, received["global"], self.pcfg.apfl_alpha)
        return None

    def initial_state(self) -> WeightSet:
        init = self._initial_segmentation()
        state: WeightSet = {"global": init, "selector": self._initial_selector(self.num_selector_classes)}
        if self.softpull:
            state |= {f"personal/{s}": init for s in self.site_names}
        elif self.personalization in SHARED_TRACK_RULES:
            state["shared"] = init
        if self.reference_selector:
            state[OPTIM_PART] = initial_optimizer_state(self._selector_template())
        return state

    def _personal_part(self, state: WeightSet, site: str, phase: str) -> Weights | None:
        """The ``personal`` part ``site`` receives in ``phase``: its SoftPull model, the shared U-Net of
        Per-FedAvg / pFedMe (Per-FedAvg adapts it in the last round too), or nothing."""
        if self.softpull:
            return state[f"personal/{site}"]
        if self.personalization in SHARED_TRACK_RULES and (phase == "train" or self.personalization == "perfedavg"):
            return state["shared"]
        return None

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        phase = self.phase(rnd)
        style = self.style_quantile is not None
        personal = self._personal_part(state, site, phase)
        if phase == "calibrate":
            weights = {"global": state["global"], "selector": state["selector"]}
            if personal is not None:
                weights["personal"] = personal
            if style and state.get(GATE_PART):
                weights[GATE_PART] = {k: v for k, v in state[GATE_PART].items() if k in SITE_GATE_KEYS}
            return SiteInstructions(rnd, weights, {"phase": "calibrate", "calibration": self.selector_calibration})
        if phase == "selector":
            return SiteInstructions(rnd, {"selector": state["selector"], OPTIM_PART: state[OPTIM_PART]},
                                    {"phase": "selector", "style": style})
        weights = {"global": state["global"], "selector": state["selector"]}
        if personal is not None:
            weights["personal"] = personal
        if self.reference_selector:
            weights[OPTIM_PART] = state[OPTIM_PART]
        return SiteInstructions(rnd, weights, {"phase": "train", "style": style})

    def validate_update(self, state: WeightSet, site: str, update: SiteUpdate) -> None:
        update = self._checked_final_personal(state, site, update)
        if self.style_quantile is not None:
            update = self._checked_style_parts(site, update)
        parts = set(update.weights)
        if parts <= LAST_ROUND_PARTS:  # the last round's answer
            if "selector_stats" in parts:
                check_statistics(update.weights["selector_stats"], self.num_selector_classes,
                                 f"selector statistics from {site}")
            if TEMPERATURE_PART in parts:
                check_temperature_statistics(update.weights[TEMPERATURE_PART], f"temperature statistics from {site}")
            if GAMMA_PART in parts:
                check_histogram_statistics(update.weights[GAMMA_PART], len(self._gamma_temperatures()),
                                           f"confidence histogram from {site}")
            if ROUTING_PART in parts:
                if not self.compares_routings:
                    raise ConfigError(f"update from {site} sends style-routing counts, but this federation does "
                                      "not compare routing rules")
                if GAMMA_PART not in parts:
                    raise ConfigError(f"update from {site} sends style-routing counts without the selector's "
                                      "confidence histogram of the same images")
                check_routing_statistics(update.weights[ROUTING_PART], f"style-routing counts from {site}")
            check_validation_metrics(update.metrics, f"validation Dice from {site}")
            if update.num_samples <= 0:
                raise ConfigError(f"update from {site} reports {update.num_samples} training samples")
        elif parts == {"selector", OPTIM_PART}:  # a warm-up round's answer
            check_compatible(state["selector"], update.weights["selector"], f"selector update from {site}")
            check_compatible(state[OPTIM_PART], update.weights[OPTIM_PART], f"selector optimizer state from {site}")
            if update.num_samples <= 0:
                raise ConfigError(f"update from {site} reports {update.num_samples} training samples")
        else:
            super().validate_update(state, site, update)

    def _checked_final_personal(self, state: WeightSet, site: str, update: SiteUpdate) -> SiteUpdate:
        """With a rule other than SoftPull: check the personalized model of a last-round answer and
        return the update without it (a training or warm-up answer is returned as it is).

        A last-round answer is one without a global model and without the selector's Adam state
        (which every warm-up answer carries); with such a rule it must carry the site's
        personalized model, shaped like the global model.
        """
        parts = set(update.weights)
        if self.softpull or "global" in parts or OPTIM_PART in parts:
            return update
        if "personal" not in parts:
            raise ConfigError(f"last-round update from {site} lacks its personalized model (part 'personal'); "
                              f"this federation trains them with {self.personalization!r}, so the site builds "
                              "its model in the last round and sends it once")
        check_compatible(state["global"], update.weights["personal"], f"personalized model from {site}")
        return SiteUpdate({k: v for k, v in update.weights.items() if k != "personal"}, update.num_samples,
                          update.metrics)

    def _checked_style_parts(self, site: str, update: SiteUpdate) -> SiteUpdate:
        """Check the style gate's parts of ``update`` and return the update without them.

        A training or warm-up answer must carry the site's descriptor sums; a last-round answer
        carries its distance histogram when the site received the gate.
        """
        weights = dict(update.weights)
        stats, hist = weights.pop(STATS_PART, None), weights.pop(HIST_PART, None)
        last_round = set(weights) <= LAST_ROUND_PARTS
        if last_round:
            if stats is not None:
                raise ConfigError(f"update from {site} sends style statistics in the last round")
            if hist is not None:
                check_distance_histogram(hist, f"style distance histogram from {site}")
        else:
            if hist is not None:
                raise ConfigError(f"update from {site} sends a style distance histogram outside the last round")
            if stats is None:
                raise ConfigError(f"update from {site} lacks its style statistics (part {STATS_PART!r}); the "
                                  "federation runs the site-style gate, so every training round must carry them")
            check_style_statistics(stats, self.task.in_channels, f"style statistics from {site}")
            if float(stats["count"][0]) != update.num_samples:
                raise ConfigError(f"update from {site} describes {float(stats['count'][0]):g} images in its style "
                                  f"statistics but trained on {update.num_samples}")
        return SiteUpdate(weights, update.num_samples, update.metrics)

    def expected_update_shapes(self, state: WeightSet, site: str) -> WeightSet:
        out = {"global": state["global"], "selector": state["selector"]}
        personal = self._personal_part(state, site, "train")
        if personal is not None:
            out["personal"] = personal
        if self.reference_selector:
            out[OPTIM_PART] = state[OPTIM_PART]
        return out

    def _keep_style_statistics(self, state: WeightSet, new: WeightSet, updates: Mapping[str, SiteUpdate]) -> None:
        """Store each answering site's latest descriptor sums and refit the gate from every site's latest."""
        if self.style_quantile is None:
            return
        kept = dict(state.get(STATS_PART, {}))
        for site, u in updates.items():
            if STATS_PART in u.weights:
                kept |= {f"{site}.{k}": v for k, v in u.weights[STATS_PART].items()}
        new[STATS_PART] = kept
        per_site = [{k: kept[f"{s}.{k}"] for k in ("count", "sum", "outer")} if f"{s}.count" in kept else None
                    for s in self.site_names]
        gate = fit_style_gate(per_site)
        if gate:
            new[GATE_PART] = gate

    def _calibrate(self, state: WeightSet, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        new = dict(state)
        weight_key, bias_key = final_layer_keys(self._selector_template())
        temperature = 1.0
        if self.selector_calibration == "lda":
            stats = add_statistics([u.weights["selector_stats"] for u in updates.values()])
            new["selector"] = calibrated_selector(state["selector"], stats, weight_key, bias_key)
        elif self.selector_calibration == "temperature":
            temperature = fit_temperature([u.weights[TEMPERATURE_PART] for u in updates.values()])
            new["selector"] = apply_temperature(state["selector"], weight_key, bias_key, temperature)
            new["selector_calibration"] = {"temperature": torch.tensor([temperature], dtype=torch.float64)}
        if self.gamma_pass is not None:
            temps = self._gamma_temperatures()
            row = temps.index(temperature) if self.selector_calibration == "temperature" else 0
            chosen = choose_gamma([u.weights[GAMMA_PART] for u in updates.values()], self.gamma_pass,
                                  self.num_selector_classes, row)
            new[GAMMA_PART] = {k: torch.tensor([v], dtype=torch.float64) for k, v in chosen.items()}
        if self.style_quantile is not None and new.get(GATE_PART):
            threshold = threshold_from_histograms([u.weights[HIST_PART] for u in updates.values()
                                                   if HIST_PART in u.weights], self.style_quantile)
            new[GATE_PART] = {**new[GATE_PART], "threshold": torch.tensor([threshold], dtype=torch.float64),
                              "quantile": torch.tensor([self.style_quantile], dtype=torch.float64)}
        dice = {f"{site}.{which}": torch.tensor([u.metrics[metric]], dtype=torch.float64)
                for site, u in updates.items() for which, metric in VALIDATION_METRICS.items()
                if metric in u.metrics}
        if dice:
            new["validation_dice"] = {**state.get("validation_dice", {}), **dice}
        if not self.softpull:
            # each site's model as it built it; a site that did not answer has none: it gets the
            # global model (and reports no validation Dice, so the guard routes its images to global)
            for site in self.site_names:
                answer = updates.get(site)
                new[f"personal/{site}"] = (answer.weights["personal"] if answer is not None
                                           and "personal" in answer.weights else new["global"])
        counted = [u.weights[ROUTING_PART] for u in updates.values() if ROUTING_PART in u.weights]
        if self.compares_routings and counted:
            row = self._gamma_temperatures().index(temperature) if self.selector_calibration == "temperature" else 0
            gamma = self.routing_gamma(new)
            share = selector_own_share([u.weights[GAMMA_PART] for u in updates.values() if GAMMA_PART in u.weights],
                                       gamma, row)
            choice = choose_site_routing(share, counted)
            new[CHOICE_PART] = {k: torch.tensor([v], dtype=torch.float64) for k, v in choice.items()}
            log.info("site routing: %s (validation images to their own site's model: selector %.3f at gamma %.2f, "
                     "style %.3f)", "style" if choice["style"] else "selector", choice["selector_own"], gamma,
                     choice["style_own"])
        return new

    def _gamma_temperatures(self) -> tuple[float, ...]:
        """Temperatures a site's confidence histogram has rows for: the grid when temperature scaling is fitted."""
        return tuple(TEMPERATURE_GRID) if self.selector_calibration == "temperature" else (1.0,)

    def _selector_template(self) -> Any:
        return build_selector(self.task.in_channels, self.num_selector_classes,  # type: ignore[arg-type]
                              self.training.selector_head, self.training.selector_width)

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        phase = self.phase(rnd)
        if phase == "calibrate":
            return self._calibrate(state, updates)
        new = dict(state)
        new["selector"] = fedavg([(u.weights["selector"], u.num_samples) for u in updates.values()])
        self._keep_style_statistics(state, new, updates)
        if phase == "selector":
            new[OPTIM_PART] = fedavg([(u.weights[OPTIM_PART], u.num_samples) for u in updates.values()])
            return new
        new["global"] = fedavg([(u.weights["global"], u.num_samples) for u in updates.values()])
        if self.reference_selector:
            # the reference averages Adam's moments with the same weights as the selector itself
            new[OPTIM_PART] = fedavg([(u.weights[OPTIM_PART], u.num_samples) for u in updates.values()])
        self._aggregate_personal(state, new, updates)
        return new

    def _aggregate_personal(self, state: WeightSet, new: WeightSet, updates: Mapping[str, SiteUpdate]) -> None:
        """A training round's server step for the personalization rule (APFL and fine-tuning have none)."""
        if self.softpull:
            for site, weights in soft_pull({s: u.weights["personal"] for s, u in updates.items()}, self.lam).items():
                new[f"personal/{site}"] = weights
        elif self.personalization in SHARED_TRACK_RULES:
            answers = [(u.weights["personal"], u.num_samples) for u in updates.values()]
            new["shared"] = shared_model_update(self.personalization, state["shared"], answers, self.pcfg)

    def _statistics_update(self, instructions: SiteInstructions, site: SiteRuntime,
                           labels: np.ndarray) -> SiteUpdate:
        stats = selector_statistics(self.task, instructions.weights["selector"], self.num_selector_classes,
                                    site.train.images, labels, self.training)
        return SiteUpdate({"selector_stats": stats}, len(site.train.images), {})

    def _final_update(self, instructions: SiteInstructions, site: SiteRuntime) -> SiteUpdate:
        """The last round at a site: validation Dice of both models, and the calibration's statistics."""
        w = instructions.weights
        n = len(site.train.images)
        metrics = site_validation_dice(self.task, w, site, self.training)
        parts: WeightSet = {}
        val = site.validation
        # a site without validation images scores its training images instead
        scored = val if val is not None and len(val.images) else site.train
        images = scored.images
        # with the gate (it judges cases) the super model routes a volume whole, so the routing rules are
        # measured on volumes too: each image counts with its volume's decision
        cases = scored.case_ids if GATE_PART in w else None
        if self.selector_calibration == "lda":
            parts = self._statistics_update(instructions, site, np.full(n, site.index)).weights
        elif self.selector_calibration == "temperature" or self.gamma_pass is not None or self.compares_routings:
            logits = selector_logits(self.task, w["selector"], self.num_selector_classes, images, self.training)
            labels = np.full(len(images), site.index)
            if self.selector_calibration == "temperature":
                parts[TEMPERATURE_PART] = temperature_statistics(logits, labels)
            if self.gamma_pass is not None or self.compares_routings:
                parts[GAMMA_PART] = histogram_statistics(logits, labels, self._gamma_temperatures(), cases=cases)
        if GATE_PART in w:
            # cases the gate has not seen: the validation cases, and each training case under the gate
            # refitted without it (engine.fl.style_gate.calibration_distances); only the histogram leaves the site
            parts[HIST_PART] = distance_histogram(calibration_distances(
                w[GATE_PART], site.index, site.train.images, site.train.case_ids,
                val.images if val is not None else None, val.case_ids if val is not None else None))
            if self.compares_routings:
                _, nearest = nearest_sites(*style_distance_matrix(style_descriptors(images), w[GATE_PART]), cases)
                parts[ROUTING_PART] = style_routing_statistics(nearest, site.index)
        return SiteUpdate(parts, n, metrics)

    def _final_update_with_personal(self, instructions: SiteInstructions, site: SiteRuntime,
                                    ctx: RoundContext) -> SiteUpdate:
        """The last round with a rule other than SoftPull: build the site's personalized model from
        its private state (:func:`engine.fl.personalization.personalized_model`), score it like
        SoftPull's for the guard, and send it once with the rest of the last-round answer."""
        w = instructions.weights
        personal = personalized_model(self.personalization, self.task, w, site.train,
                                      self.round_training(instructions.round), self.pcfg, site.state,
                                      self._site_seed(instructions.round, site), ctx)
        update = self._final_update(SiteInstructions(instructions.round, {**w, "personal": personal},
                                                     instructions.config), site)
        return SiteUpdate({**update.weights, "personal": personal}, update.num_samples, update.metrics)

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        phase = self.phase(instructions.round)
        ctx = self._context(instructions.round, site, progress, cancel)
        if phase == "calibrate":
            if self.softpull:
                return self._final_update(instructions, site)
            return self._final_update_with_personal(instructions, site, ctx)
        w = instructions.weights
        seed = self._fedavg_seed(instructions.round, site)  # the global model trains on FedAvg's batches
        if phase == "selector":
            sel, optim, sel_metrics = reference_selector_round(
                self.task, w["selector"], w[OPTIM_PART], np.full(len(site.train.images), site.index),
                self.num_selector_classes, site.train.images, self.training, derived_seed(seed, "selector"), ctx)
            return SiteUpdate({"selector": sel, OPTIM_PART: optim, **self._style_part(instructions, site)},
                              len(site.train.images), sel_metrics)
        if self.softpull:
            glob, pers, sel, metrics = train_fedsm_round(
                self.task, w["global"], w["personal"], w["selector"], site.index, len(self.site_names),
                site.train, self.round_training(instructions.round), seed, ctx,
                train_selector=not self.reference_selector)
            parts = {"global": glob, "personal": pers, "selector": sel}
        else:
            parts, metrics = train_personalized_round(
                self.personalization, self.task, w, site.index, len(self.site_names), site.train,
                self.round_training(instructions.round), self.pcfg, site.state, seed, ctx,
                train_selector=not self.reference_selector)
        if self.reference_selector:
            labels = np.full(len(site.train.images), site.index)
            sel, optim, sel_metrics = reference_selector_round(
                self.task, w["selector"], w[OPTIM_PART], labels, self.num_selector_classes, site.train.images,
                self.training, derived_seed(seed, "selector"), ctx)
            parts |= {"selector": sel, OPTIM_PART: optim}
            metrics |= sel_metrics
        return SiteUpdate(parts | self._style_part(instructions, site), len(site.train.images), metrics)

    @staticmethod
    def _style_part(instructions: SiteInstructions, site: SiteRuntime) -> WeightSet:
        """The site's descriptor sums when the federation runs the style gate (else nothing)."""
        return {STATS_PART: style_statistics(site.train.images)} if instructions.config.get("style") else {}


def site_validation_dice(task: TaskSpec, weights: Mapping[str, Weights], site: SiteRuntime,
                         training: LocalTrainingConfig) -> dict[str, float]:
    """Mean validation Dice of the received global and personalized models at ``site``.

    With both models, also the number of validation cases (``val_cases``) and the sample
    standard deviation over cases of the personalized model's Dice minus the global model's
    (``val_dice_diff_sd``; 0 with one case), so the routing guard can ask whether the
    personalized model's lead is larger than the noise of a few cases
    (:mod:`engine.inference.guard`). Aggregates only: no per-case value leaves the site.
    ``{}`` when the site has no validation images (the guard then routes its images to global).
    """
    val = site.validation
    if val is None or not len(val.images):
        return {}
    out: dict[str, float] = {}
    per_case: dict[str, np.ndarray] = {}
    for which, key in (("global", "global"), ("personal", "personal")):
        if key in weights:
            masks = segment_with(task, weights[key], val.images, training.device)
            per_case[which] = dice_per_case(masks, val.masks, val.case_ids).mean(axis=1)  # mean over structures
            out[f"val_dice_{which}"] = float(np.mean(per_case[which]))
    if len(per_case) == 2:
        diff = per_case["personal"] - per_case["global"]
        out["val_cases"] = float(len(diff))
        out["val_dice_diff_sd"] = float(np.std(diff, ddof=1)) if len(diff) > 1 else 0.0
    return out


def check_validation_metrics(metrics: Mapping[str, float], what: str) -> None:
    """Reject validation Dice values that are not numbers in [0, 1], a case count that is not a whole
    number >= 0, and a standard deviation of Dice differences outside [0, 1]."""
    for key in ("val_dice_global", "val_dice_personal", "val_dice_diff_sd"):
        if key in metrics:
            value = metrics[key]
            if not isinstance(value, int | float) or not np.isfinite(value) or not 0.0 <= value <= 1.0:
                raise WeightsError(f"{what}: {key} is {value!r}, expected a number in [0, 1]")
    if "val_cases" in metrics:
        value = metrics["val_cases"]
        if not isinstance(value, int | float) or not np.isfinite(value) or value < 0 or value != round(value):
            raise WeightsError(f"{what}: val_cases is {value!r}, expected a whole number >= 0")


class FedSMExtra(FedSM):
    """FedSM-extra (paper Algorithms 3-4): selector trained afterwards over K+1 models.

    Rounds ``1..rounds`` train the global and personalized models (FedAvg + SoftPull).
    Rounds ``rounds+1..rounds+extra_rounds`` train only the selector, with label = index of the
    model (0 = global, k = site k's personalized model) whose prediction has the lowest Dice
    loss against the ground truth; a last round calibrates the selector's last layer with the
    same labels. Inference takes the argmax over K+1. Selector rounds send every site all K+1
    segmentation models so it can compute those labels (the method's price).
    """

    name = "fedsm-extra"

    def __init__(self, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig,
                 seed: int = 0, rounds: int = 1, lam: float = 0.7, gamma: float = 0.6,
                 extra_rounds: int = 1) -> None:
        # FedSM-extra keeps the per-batch selector and the LDA last layer (its own baseline)
        super().__init__(task, site_names, training, seed, rounds, lam, gamma, selector_calibration="lda")
        if extra_rounds < 1:
            raise ConfigError(f"FedSM-extra needs extra_rounds >= 1, got {extra_rounds}")
        self.extra_rounds = extra_rounds

    @classmethod
    def from_settings(cls, task: TaskSpec, site_names: list[str], training: LocalTrainingConfig, seed: int,
                      rounds: int, settings: Any) -> FedSMExtra:
        # argmax routing: gamma is not used
        return cls(task, site_names, training, seed, rounds, lam=float(settings.lam or 0),
                   gamma=settings.fixed_gamma, extra_rounds=int(settings.extra_rounds or 1))

    @property
    def num_selector_classes(self) -> int:
        return len(self.site_names) + 1

    @property
    def total_rounds(self) -> int:
        return self.rounds + self.extra_rounds + 1

    def phase(self, rnd: int) -> str:
        """``"train"``, ``"selector"`` (extra rounds) or ``"calibrate"`` (last round)."""
        if rnd == self.total_rounds:
            return "calibrate"
        return "selector" if rnd > self.rounds else "train"

    def wire_parts(self, rnd: int) -> frozenset[str]:
        """FedSM's, and every site's personalized model that the selector rounds send for labelling."""
        parts = super().wire_parts(rnd)
        return parts | {f"personal/{s}" for s in self.site_names} if parts else parts

    def site_instructions(self, state: WeightSet, rnd: int, site: str) -> SiteInstructions:
        phase = self.phase(rnd)
        if phase == "train":
            return SiteInstructions(rnd, {"global": state["global"], "personal": state[f"personal/{site}"]},
                                    {"phase": phase})
        weights = {"selector": state["selector"], "global": state["global"]}
        weights |= {f"personal/{s}": state[f"personal/{s}"] for s in self.site_names}
        return SiteInstructions(rnd, weights, {"phase": phase})

    def validate_update(self, state: WeightSet, site: str, update: SiteUpdate) -> None:
        parts = set(update.weights)
        if parts == {"selector_stats"}:
            check_statistics(update.weights["selector_stats"], self.num_selector_classes,
                             f"selector statistics from {site}")
        elif parts == {"selector"}:
            check_compatible(state["selector"], update.weights["selector"], f"selector update from {site}")
        elif parts == {"global", "personal"}:
            check_compatible(state["global"], update.weights["global"], f"global update from {site}")
            check_compatible(state[f"personal/{site}"], update.weights["personal"], f"personal update from {site}")
        else:
            raise ConfigError(f"update from {site} has unexpected parts {sorted(parts)}")
        if update.num_samples <= 0:
            raise ConfigError(f"update from {site} reports {update.num_samples} training samples")

    def _calibrate(self, state: WeightSet, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        """LDA with the *empirical* class priors: ``log(n_c / n)`` added to each class's score.

        FedSM's own calibration uses uniform priors (a small site must not lose its images to a
        big one). FedSM-extra's classes are "which of the K+1 models segments this image best",
        and those labels are highly imbalanced (the global model wins most images); the Bayes
        rule for them includes the priors, estimated from the summed per-class counts (which the
        sites send anyway). A class with no samples keeps its score far below the others.
        """
        new = super()._calibrate(state, updates)
        stats = add_statistics([u.weights["selector_stats"] for u in updates.values()])
        _, bias_key = final_layer_keys(self._selector_template())
        new["selector"] = dict(new["selector"])
        new["selector"][bias_key] = new["selector"][bias_key] + empirical_log_priors(stats["count"]).to(
            new["selector"][bias_key].dtype)
        return new

    def aggregate(self, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate]) -> WeightSet:
        phase = self.phase(rnd)
        if phase == "calibrate":
            return self._calibrate(state, updates)
        new = dict(state)
        if phase == "selector":
            new["selector"] = fedavg([(u.weights["selector"], u.num_samples) for u in updates.values()])
            return new
        new["global"] = fedavg([(u.weights["global"], u.num_samples) for u in updates.values()])
        for site, weights in soft_pull({s: u.weights["personal"] for s, u in updates.items()}, self.lam).items():
            new[f"personal/{site}"] = weights
        return new

    def train_at_site(self, instructions: SiteInstructions, site: SiteRuntime,
                      progress: Any = None, cancel: Any = None) -> SiteUpdate:
        ctx = self._context(instructions.round, site, progress, cancel)
        w = instructions.weights
        seed = self._fedavg_seed(instructions.round, site)  # the global model trains on FedAvg's batches
        n = len(site.train.images)
        phase = self.phase(instructions.round)
        if phase == "train":
            cfg = self.round_training(instructions.round)
            glob, m1 = train_segmentation_round(self.task, w["global"], site.train, cfg, seed, ctx)
            pers, m2 = train_segmentation_round(self.task, w["personal"], site.train, cfg,
                                                derived_seed(seed, "personal"), ctx)
            return SiteUpdate({"global": glob, "personal": pers}, n,
                              {"loss_global": m1["loss"], "loss_personal": m2["loss"]})
        labels = best_model_labels(self.task, w["global"], [w[f"personal/{s}"] for s in self.site_names],
                                   site.train, self.training, ctx)
        if phase == "calibrate":
            return self._statistics_update(instructions, site, labels)
        sel, metrics = train_selector_round(self.task, w["selector"], labels, self.num_selector_classes,
                                            site.train, self.training, seed, ctx)
        counts = np.bincount(labels, minlength=self.num_selector_classes)
        metrics |= {f"label_share_{i}": float(c) / max(n, 1) for i, c in enumerate(counts)}
        return SiteUpdate({"selector": sel}, n, metrics)


def empirical_log_priors(count: torch.Tensor) -> torch.Tensor:
    """``log(n_c / n)`` per class from summed class counts; 0 for classes without samples (already excluded)."""
    count = count.to(torch.float64)
    total = float(count.sum())
    if total <= 0:
        raise WeightsError("selector statistics hold no samples")
    out = torch.zeros_like(count)
    present = count > 0
    out[present] = torch.log(count[present] / total)
    return out


def check_statistics(stats: Mapping[str, torch.Tensor], num_classes: int, what: str) -> None:
    """Reject selector statistics with wrong keys, shapes or non-finite values."""
    if set(stats) != set(STAT_KEYS):
        raise WeightsError(f"{what}: keys {sorted(stats)}, expected {list(STAT_KEYS)}")
    count, sums, outer = stats["count"], stats["sum"], stats["outer"]
    dim = outer.shape[0] if outer.dim() == 2 else -1
    if (tuple(count.shape) != (num_classes,) or sums.dim() != 2 or tuple(sums.shape) != (num_classes, dim)
            or tuple(outer.shape) != (dim, dim)):
        raise WeightsError(f"{what}: shapes count {tuple(count.shape)}, sum {tuple(sums.shape)}, "
                           f"outer {tuple(outer.shape)} do not fit {num_classes} classes")
    for key in STAT_KEYS:
        if not all_finite(stats[key]):
            raise WeightsError(f"{what}: {key} contains NaN or Inf")
    if bool((count < 0).any()):
        raise WeightsError(f"{what}: negative sample counts")


def selector_statistics(task: TaskSpec, selector_weights: Mapping[str, torch.Tensor], num_classes: int,
                        images: np.ndarray, labels: np.ndarray, training: LocalTrainingConfig) -> Weights:
    """Site half of the calibration round: feature statistics of the site's training images."""
    device = Device.resolve(training.device)
    net = build_selector(task.in_channels, num_classes, training.selector_head,  # type: ignore[arg-type]
                         training.selector_width)
    net.load_state_dict(selector_weights)
    net.to(device.torch_device)
    small = torch.from_numpy(selector_inputs(images, training.selector_size)).to(device.torch_device)
    return class_statistics(penultimate_features(net, small), labels, num_classes)



