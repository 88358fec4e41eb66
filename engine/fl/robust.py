"""Bounds on what one site's answer can do to the federation, checked before it is aggregated.

A site is authenticated, but its answer is still only data: a broken or hostile site can scale
its weights, claim any number of training samples, or send parts the round does not expect.
Plain FedAvg weighs by the claimed sample count, so ``num_examples = 10^12`` with zero weights
replaces the global model, and an update scaled by 10^6 ruins it. The coordinator therefore
screens every decoded, shape-checked update (:func:`screen_update`):

- **Sample count.** ``num_examples`` must not exceed the site's declared count
  (``[robust] num_examples = {site1 = 120, ...}`` in ``federation.toml``, the value agreed at
  enrolment), or, for a site without one, the count of its first accepted answer in this
  coordinator process times ``num_examples_growth`` (default 1.0: a site's training set does
  not grow during a run), and never ``max_num_examples`` (default 10^7).
- **Update size.** For every model part of the update (:data:`NORM_PARTS`: the global model,
  the site's personalized model, the selector, Scaffold's control change), the
  relative change ``||update - reference|| / ||reference||`` must not exceed
  ``max_relative_update`` (default 10.0; a round of local training moves a model by a few
  percent to a few tenths of its norm, see docs/federation.md). A part whose reference is all
  zeros (Scaffold's control in round 1) is measured against the largest reference part's norm.
  ``norm_action = "reject"`` (default) leaves the site out of the round; ``"clip"`` scales the
  change down to the bound and keeps it. Either way an ``error`` event names the site and the
  ratio.
- **Schema.** An update the method cannot aggregate (e.g. a FedSM answer holding only the
  selector statistics in a training round) is found by :func:`aggregate_leaving_out`: if the
  aggregation of all updates fails, each update is aggregated alone, those that fail are left
  out, and the rest are aggregated. Nothing a site sends ends the coordinator.

- **Update size against the others** (``clip``, :func:`clip_to_median`). A site inside the
  bound can still push every round: an update scaled ×5 moves a model by a relative ~4. Each
  round, every model part's change is clipped to ``clip`` times the median of the answering
  sites' change norms of that part, so no site moves the average further than a typical site
  does (Sun et al., "Can you really backdoor federated learning?", 2019, clip to a norm
  bound; here the bound is the round's own median, so it needs no tuning per task). A site with
  more data takes more local steps and moves further: the trained parts (:data:`STEP_PARTS`)
  are compared per square root of the site's (bounded) sample count, so the median is of
  ``norm / sqrt(n)`` and each site's bound is that times ``sqrt(n)`` (measured on cpu-small:
  honest change norms grow as ``n^0.5`` to ``n^0.85``; compared raw, the largest site of six
  was read as 2.9x the median and clipped every round, docs/results.md).

- **Direction against the others** (``min_cosine``, :func:`opposed_sites`). Clipping bounds how far
  a site moves the average, not where to: a large site that flips the sign of its change every round
  (37 % of FedAvg's weight on cpu-small fundus) cost -0.25 Dice under every norm rule. Each round,
  for the segmentation model every site averages into one (:data:`SHARED_PARTS`; not FedSM's selector,
  whose honest changes oppose each other by construction), each site's change
  is compared with the coordinate-wise median of the *other* sites' changes; a site whose cosine with
  it, averaged over the run's rounds (:class:`DirectionMemory`, ``direction_memory``), is below
  ``min_cosine`` is left out of the round with an ``error`` event. The others' median is a consensus
  one attacker cannot carry when at least four sites answer; with fewer there is no check. A round
  counts as evidence only while the sites are still moving the part together: their median change at
  least ``direction_min_change`` of its largest in the run so far, and their median cosine above 0.
  Near convergence, with a decaying learning rate, honest changes are small and stop sharing a
  direction, and a site's reach is small too (the clip holds it to twice the median change).

Optionally ``aggregation = "median"`` or ``"trimmed_mean"`` (with ``trim``, the fraction cut at
each end, default 0.2) replaces the weighted mean of the parts that FedAvg, FedProx and FedSM's
training rounds average (``global``, ``selector``) by the coordinate-wise median or trimmed
mean of the sites' parts, which no single site can move far.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from engine.catalogue import mean_aggregation_methods
from engine.errors import CancelledError, ConfigError, WeightsError

if TYPE_CHECKING:
    from engine.fl.methods import FederatedMethod, SiteUpdate, WeightSet

log = logging.getLogger(__name__)

#: Default bound of ``||update - reference|| / ||reference||`` per part.
MAX_RELATIVE_UPDATE = 10.0
#: Default largest sample count any site may claim.
MAX_NUM_EXAMPLES = 10_000_000
AGGREGATIONS = ("mean", "median", "trimmed_mean")
#: Update parts that are model weights (or Scaffold's control change): the ones whose size is bounded.
#: Optimizer state a method may carry along (e.g. the selector's Adam moments) is not a model and
#: legitimately changes by orders of magnitude relative to its previous value.
NORM_PARTS = ("global", "personal", "selector", "control_delta")
#: Parts a site changes by local optimizer steps (their number grows with its sample count), compared
#: per ``sqrt(num_samples)`` by :func:`clip_to_median`. Scaffold's control change is an average gradient
#: and does not grow with the data (measured: flat across site sizes), so it is compared as it is.
STEP_PARTS = ("global", "personal", "selector")
#: Parts every site averages into one shared model, whose direction :func:`opposed_sites` compares. A
#: personalized model is its site's own, and Scaffold's control change corrects each site's own drift: both
#: legitimately point their own way. So does FedSM's selector, although it is averaged: each site trains it
#: on one label, its own, so its change raises its own class and lowers the others', and honest sites'
#: selector changes oppose each other more as the selector learns (cpu-converged prostate, seed 0, with
#: the selector judged too: the two largest sites were left out of 91 and 94 of 150 rounds from round 55
#: on, selector cosines down to -0.74, while their global changes agreed). The clip still bounds a
#: site's selector change to ``clip`` times the median, and the style gate and routing guard sit
#: between the selector and any image.
SHARED_PARTS = ("global",)
#: Fewest answering sites for the direction check: three others, so that one site cannot carry their median.
MIN_SITES_FOR_DIRECTION = 4
_KEYS = {"max_relative_update", "norm_action", "num_examples", "num_examples_growth", "max_num_examples",
         "aggregation", "trim", "max_reply_mb", "clip", "min_cosine", "direction_memory", "direction_min_change"}
#: Default ``clip``: each part's change at most this many times the round's median change norm (per
#: sqrt(sample count) for the trained parts; 0: off). 2: honest sites are left alone (cpu-small fundus
#: and prostate, 3 seeds: the same Dice as no clipping), a site pushing x5 is held to about twice its
#: honest change (docs/results.md, "Robust aggregation").
CLIP_TO_MEDIAN = 2.0
#: Default ``min_cosine``: a site whose change of a shared model has a cosine below this with the other sites'
#: coordinate-wise median change is left out of the round (-1: off). See docs/results.md, "Robust aggregation".
MIN_COSINE = -0.07
#: Default ``direction_memory``: the weight of a site's earlier rounds in the direction evidence it is judged by
#: (an exponential moving average of its cosines; 0: this round alone). An honest site's cosine can dip far
#: below ``min_cosine`` for a round or two late in a run (FedProx on cpu-small fundus: -0.306) after rounds of
#: agreement; a site that flips its change is below it from its first flipped round on. 0.8 keeps every honest
#: site and leaves out every flipped site in every cpu-small round measured (5-6 rounds; docs/results.md,
#: "Robust aggregation").
DIRECTION_MEMORY = 0.8
#: Default ``direction_min_change``: a round's cosines count as direction evidence only while the sites' median
#: change of the part (per sqrt of sample count) is at least this share of its largest in the run so far (0: every
#: round). Near convergence with a decaying learning rate (cpu-converged, cosine decay) honest changes shrink to a
#: few percent of the first rounds' and their directions stop agreeing: judged there, honest sites drift below
#: ``min_cosine`` (FedAvg fundus: 28 of 360 site-rounds from round 48) while a site already left out would drift
#: back in. In the rounds not judged the evidence stays as it was (docs/results.md, "Longer runs").
DIRECTION_MIN_CHANGE = 0.4
#: A round counts as direction evidence only when the sites' median cosine is above this: with no shared direction
#: there is nothing to oppose (honest cpu-converged fundus, seed 2: median cosine -0.03...+0.01 from round 29,
#: while the changes were still 0.4 of the first rounds').
MIN_CONSENSUS = 0.0


class UpdateRejected(WeightsError):
    """A site's update breaks a bound of :class:`RobustSettings`."""


@dataclass(frozen=True)
class RobustSettings:
    """The ``[robust]`` table of ``federation.toml`` (every key optional)."""

    max_relative_update: float = MAX_RELATIVE_UPDATE
    norm_action: str = "reject"
    num_examples: dict[str, int] = field(default_factory=dict)
    num_examples_growth: float = 1.0
    max_num_examples: int = MAX_NUM_EXAMPLES
    aggregation: str = "mean"
    trim: float = 0.2
    #: each model part's change clipped to this many times the round's median change norm (0: off)
    clip: float = CLIP_TO_MEDIAN
    #: a site whose shared-model change has a lower cosine with the others' median change is left out (-1: off)
    min_cosine: float = MIN_COSINE
    #: weight of a site's earlier rounds in the direction evidence judged against ``min_cosine`` (0: this round alone)
    direction_memory: float = DIRECTION_MEMORY
    #: a round is direction evidence only while the median change is at least this share of the run's largest (0: all)
    direction_min_change: float = DIRECTION_MIN_CHANGE
    #: largest reply a site may upload, MiB (0: twice the method's largest legitimate reply, at least 128 MiB)
    max_reply_mb: float = 0.0

    @classmethod
    def from_dict(cls, table: Mapping[str, Any] | None, where: str = "[robust]") -> RobustSettings:
        """Check and convert the table; :class:`ConfigError` naming the key on any mistake."""
        table = dict(table or {})
        unknown = sorted(set(table) - _KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")

        def number(key: str, default: float, low: float, integer: bool = False) -> Any:
            value = table.get(key, default)
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < low:
                raise ConfigError(f"{where}: {key} = {value!r} must be a{'n integer' if integer else ' number'} "
                                  f">= {low:g}")
            return int(value) if integer else float(value)

        action = table.get("norm_action", "reject")
        if action not in ("reject", "clip"):
            raise ConfigError(f"{where}: norm_action = {action!r} must be \"reject\" or \"clip\"")
        aggregation = table.get("aggregation", "mean")
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"{where}: aggregation = {aggregation!r} must be one of {list(AGGREGATIONS)}")
        declared = table.get("num_examples", {})
        if not isinstance(declared, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                for k, v in declared.items()):
            raise ConfigError(f"{where}: num_examples must be a table of site = positive integer, e.g. "
                              "{site1 = 120, site2 = 80}")
        trim = number("trim", 0.2, 0.0)
        if trim >= 0.5:
            raise ConfigError(f"{where}: trim = {trim} must be below 0.5 (the fraction cut at each end)")
        min_cosine = number("min_cosine", MIN_COSINE, -1.0)
        if min_cosine > 1:
            raise ConfigError(f"{where}: min_cosine = {min_cosine} must be a cosine, between -1 (off) and 1")
        direction_memory = number("direction_memory", DIRECTION_MEMORY, 0.0)
        if direction_memory >= 1:
            raise ConfigError(f"{where}: direction_memory = {direction_memory} must be below 1 (the weight of "
                              "earlier rounds; 0: this round alone)")
        direction_min_change = number("direction_min_change", DIRECTION_MIN_CHANGE, 0.0)
        if direction_min_change > 1:
            raise ConfigError(f"{where}: direction_min_change = {direction_min_change} must be a share between 0 "
                              "(every round is evidence) and 1")
        return cls(max_relative_update=number("max_relative_update", MAX_RELATIVE_UPDATE, 1e-12),
                   norm_action=action, num_examples=dict(declared),
                   num_examples_growth=number("num_examples_growth", 1.0, 1.0),
                   max_num_examples=number("max_num_examples", MAX_NUM_EXAMPLES, 1, integer=True),
                   aggregation=aggregation, trim=trim, max_reply_mb=number("max_reply_mb", 0.0, 0.0),
                   clip=number("clip", CLIP_TO_MEDIAN, 0.0), min_cosine=min_cosine,
                   direction_memory=direction_memory, direction_min_change=direction_min_change)

    def direction_memory_for_run(self, history: list[Mapping[str, Any]] | None = None) -> DirectionMemory:
        """A run's :class:`DirectionMemory` with these settings (rebuilt from ``history`` when resuming)."""
        return DirectionMemory.from_history(self.direction_memory, history or [], self.direction_min_change)


def _norm(weights: Mapping[str, torch.Tensor]) -> float:
    total = 0.0
    for tensor in weights.values():
        if tensor.dtype.is_floating_point:
            total += float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)) ** 2
    return math.sqrt(total)


def _change_norm(update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    # the difference in the tensors' own precision (one temporary), its norm accumulated in float64
    total = 0.0
    for key, ref in reference.items():
        if ref.dtype.is_floating_point and key in update:
            diff = update[key].detach() - ref.detach()
            total += float(torch.linalg.vector_norm(diff, dtype=torch.float64)) ** 2
    return math.sqrt(total)


def _clipped(update: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
             factor: float) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in update.items():
        ref = reference.get(key)
        if ref is not None and ref.dtype.is_floating_point:
            out[key] = (ref + (value - ref) * factor).to(value.dtype)
        else:
            out[key] = value
    return out


class UpdateScreen:
    """Checks :class:`RobustSettings` on each site's update; remembers each site's first sample count.

    Parameters
    ----------
    settings
        The bounds.
    report
        Called with ``(site, message)`` for every rejected or clipped update (the coordinator
        emits an ``error`` event).
    """

    def __init__(self, settings: RobustSettings | None = None,
                 report: Callable[[str, str], None] | None = None) -> None:
        self.settings = settings or RobustSettings()
        self.report = report or (lambda site, message: log.warning("%s: %s", site, message))
        self.first_count: dict[str, int] = {}
        self._norms: dict[int, tuple[Mapping[str, torch.Tensor], float]] = {}

    def _reference_norm(self, reference: Mapping[str, torch.Tensor]) -> float:
        """``_norm(reference)``, computed once per reference (every site of a round shares the global model)."""
        hit = self._norms.get(id(reference))
        if hit is None or hit[0] is not reference:
            if len(self._norms) > 64:  # older rounds' references
                self._norms.clear()
            hit = (reference, _norm(reference))  # keeps ``reference`` alive, so its id stays unique
            self._norms[id(reference)] = hit
        return hit[1]

    def count_bound(self, site: str) -> int:
        """The largest ``num_examples`` accepted from ``site`` now."""
        s = self.settings
        if site in s.num_examples:
            return min(s.num_examples[site], s.max_num_examples)
        if site in self.first_count:
            return min(int(self.first_count[site] * s.num_examples_growth), s.max_num_examples)
        return s.max_num_examples

    def check_count(self, site: str, count: object, what: str = "update", allow_zero: bool = False) -> None:
        """:class:`UpdateRejected` unless ``count`` (a reply's ``num_examples``) is within ``site``'s bound.

        Dialogue methods (:mod:`engine.federation.flower.dialogue`) check every reply with it;
        the first positive count of a site becomes its bound when none was declared.
        """
        bound = self.count_bound(site)
        low = 0 if allow_zero else 1
        if isinstance(count, bool) or not isinstance(count, int) or not low <= count <= bound:
            raise UpdateRejected(f"{what} from {site} claims {count} training samples, more than the "
                                 f"{bound} allowed for it ([robust] num_examples / max_num_examples)")
        if count > 0:
            self.first_count.setdefault(site, count)

    def screen(self, method: FederatedMethod, state: WeightSet, site: str, update: SiteUpdate) -> SiteUpdate:
        """The update to aggregate (itself or a clipped copy); :class:`UpdateRejected` if it breaks a bound."""
        s = self.settings
        bound = self.count_bound(site)
        if not isinstance(update.num_samples, int) or not 0 < update.num_samples <= bound:
            raise UpdateRejected(f"update from {site} claims {update.num_samples} training samples, more than the "
                                 f"{bound} allowed for it ([robust] num_examples / max_num_examples)")
        reference = {part: ref for part, ref in method.expected_update_shapes(state, site).items()
                     if part in NORM_PARTS}
        norms = {part: self._reference_norm(ref) for part, ref in reference.items()}
        largest = max(norms.values(), default=0.0)
        weights = dict(update.weights)
        clipped = False
        for part, ref in reference.items():
            if part not in weights:
                continue
            scale = norms[part] if norms[part] > 0 else largest
            if scale <= 0:
                continue
            ratio = _change_norm(weights[part], ref) / scale
            if ratio <= s.max_relative_update:
                continue
            message = (f"the {part} update from {site} changes the model by {ratio:.3g} times its norm, above "
                       f"[robust] max_relative_update = {s.max_relative_update:g}")
            if s.norm_action == "reject" or not math.isfinite(ratio):
                raise UpdateRejected(message)
            weights[part] = _clipped(weights[part], ref, s.max_relative_update / ratio)
            clipped = True
            self.report(site, message + "; clipped to the bound")
        self.first_count.setdefault(site, update.num_samples)
        return replace(update, weights=weights) if clipped else update


def aggregate_leaving_out(method: FederatedMethod, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate],
                          settings: RobustSettings | None = None, report: Callable[[str, str], None] | None = None,
                          directions: DirectionMemory | None = None) -> tuple[WeightSet | None, dict[str, str]]:
    """Aggregate ``updates``; an update the method cannot aggregate is left out instead of ending the run.

    Returns the new state (``None`` when no update could be aggregated) and a reason per site
    left out: a site whose shared-model change points against the others' (``settings.min_cosine``,
    :func:`opposed_sites`, judged on the run's ``directions`` evidence; ``None``: this round's alone)
    or whose update the method cannot aggregate. The order of ``updates`` is kept (sums in configured
    site order). ``report(site, message)`` is told of every update clipped to the round's median
    (``settings.clip``).
    """
    left_out: dict[str, str] = {}
    if settings is not None and settings.min_cosine > -1:
        left_out = opposed_sites(method, state, updates, settings.min_cosine, rnd, directions)
        updates = {site: u for site, u in updates.items() if site not in left_out}
    if settings is not None and settings.clip > 0:
        updates = clip_to_median(method, state, updates, settings.clip, report)  # once, among all of them
    try:
        return _aggregate(method, state, rnd, updates, settings), left_out
    except CancelledError:
        raise
    except Exception as exc:  # one malformed answer must never end the coordinator
        log.warning("round %d: aggregation failed (%s: %s); checking each update alone", rnd, type(exc).__name__, exc)
    for site, update in updates.items():
        try:
            _aggregate(method, state, rnd, {site: update}, settings)
        except CancelledError:
            raise
        except Exception as exc:
            left_out[site] = (f"update rejected: the {method.name} aggregation of round {rnd} cannot use it "
                              f"({type(exc).__name__}: {exc})")
    kept = {site: u for site, u in updates.items() if site not in left_out}
    if not kept:
        return None, left_out
    try:
        return _aggregate(method, state, rnd, kept, settings), left_out
    except CancelledError:
        raise
    except Exception as exc:  # updates that each aggregate alone but not together
        for site in kept:
            left_out[site] = f"update rejected: the updates of round {rnd} cannot be aggregated together ({exc})"
        return None, left_out


class DirectionMemory:
    """Each site's direction evidence over a run: an exponential moving average of its cosines per shared part.

    One round's cosine cannot tell a flipped site from an honest one late in a run: on cpu-small fundus an
    honest FedProx site dipped to -0.306 after four rounds of agreement, while a flipped large site sat at
    -0.165 in the same round. A site that flips does so from the round it starts, and is judged on its
    evidence ``e = memory * e_before + (1 - memory) * cosine`` (its first cosine alone in its first judged
    round, so a site that flips from round 1 is left out of round 1). A site that agreed for many rounds
    and then flips is left out after a few rounds however long it agreed (with 0.8, the fifth flipped round
    after evidence of +0.3, at cosine -0.3).

    A round adds to the evidence of a part only while the sites are still moving it together: its median
    change size (:func:`direction_readings`) at least ``min_change`` times the largest of the run so far, and
    the median of its cosines above :data:`MIN_CONSENSUS`. In the other rounds every site's evidence stays as
    it was, so a site left out stays out and an honest site is not judged on the noise of tiny late changes.
    The readings are kept per round (:attr:`cosines`, :attr:`sizes`), so a round judged again (a repeated
    attempt) replaces its earlier reading, and a resumed coordinator rebuilds the evidence from its
    checkpoint's history (:meth:`from_history`).
    """

    def __init__(self, memory: float = DIRECTION_MEMORY, min_change: float = DIRECTION_MIN_CHANGE) -> None:
        self.memory = memory
        self.min_change = min_change
        #: ``{round: {part: {site: cosine}}}``, every round read so far
        self.cosines: dict[int, dict[str, dict[str, float]]] = {}
        #: ``{round: {part: median change size}}`` of those rounds (absent: the round counts as evidence)
        self.sizes: dict[int, dict[str, float]] = {}

    @classmethod
    def from_history(cls, memory: float, history: list[Mapping[str, Any]],
                     min_change: float = DIRECTION_MIN_CHANGE) -> DirectionMemory:
        """The evidence of a resumed run: the ``direction`` readings of each round record that has them."""
        out = cls(memory, min_change)
        for record in history:
            rnd, cosines, sizes = record.get("round"), record.get("direction"), record.get("direction_size")
            if isinstance(rnd, int) and isinstance(cosines, Mapping):
                out.cosines[rnd] = {str(part): {str(site): float(c) for site, c in by_site.items()}
                                    for part, by_site in cosines.items() if isinstance(by_site, Mapping)}
                if isinstance(sizes, Mapping):
                    out.sizes[rnd] = {str(part): float(size) for part, size in sizes.items()}
        return out

    def forget(self, rnd: int) -> None:
        """Drop round ``rnd``'s reading (an attempt of it that is not judged after all)."""
        self.cosines.pop(rnd, None)
        self.sizes.pop(rnd, None)

    def observe(self, rnd: int, cosines: Mapping[str, Mapping[str, float]],
                sizes: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
        """Record round ``rnd``'s cosines (and median change size per part); return the evidence after it for
        each site read in it that has any (a site read only in rounds that are not evidence has none)."""
        self.cosines[rnd] = {part: dict(by_site) for part, by_site in cosines.items()}
        self.sizes.pop(rnd, None)  # an earlier attempt's size
        if sizes is not None:
            self.sizes[rnd] = dict(sizes)
        evidence = self.evidence(rnd)
        return {part: {site: evidence[part][site] for site in by_site if site in evidence.get(part, {})}
                for part, by_site in cosines.items()}

    def judged(self, through: int) -> dict[int, dict[str, bool]]:
        """``{round: {part: counts as evidence}}`` for the rounds read up to ``through``."""
        out: dict[int, dict[str, bool]] = {}
        largest: dict[str, float] = {}
        for rnd in sorted(r for r in self.cosines if r <= through):
            sizes = self.sizes.get(rnd, {})
            out[rnd] = {}
            for part, by_site in self.cosines[rnd].items():
                shared = not by_site or statistics.median(by_site.values()) > MIN_CONSENSUS
                size = sizes.get(part)
                if size is None:  # a reading from before sizes were kept (an older checkpoint): judged as it was
                    out[rnd][part] = True
                    continue
                largest[part] = max(largest.get(part, 0.0), size)
                out[rnd][part] = shared and size >= self.min_change * largest[part]
        return out

    def evidence(self, through: int) -> dict[str, dict[str, float]]:
        """``{part: {site: evidence}}`` over the rounds that count as evidence up to ``through``, in round order."""
        out: dict[str, dict[str, float]] = {}
        for rnd, parts in self.judged(through).items():
            for part, judged in parts.items():
                seen = out.setdefault(part, {})
                if not judged:
                    continue
                for site, cosine in self.cosines[rnd][part].items():
                    before = seen.get(site)
                    seen[site] = cosine if before is None else self.memory * before + (1 - self.memory) * cosine
        return out

    def round_record(self, rnd: int) -> dict[str, Any]:
        """Round ``rnd``'s readings as they are kept in a round record (``direction``: cosines,
        ``direction_size``: median change size per part, ``direction_judged``: whether it counted); ``{}``
        when the round was not read."""
        if rnd not in self.cosines:
            return {}
        out: dict[str, Any] = {"direction": {part: dict(by_site) for part, by_site in self.cosines[rnd].items()}}
        if rnd in self.sizes:
            out["direction_size"] = dict(self.sizes[rnd])
            out["direction_judged"] = self.judged(rnd)[rnd]
        return out


def opposed_sites(method: FederatedMethod, state: WeightSet, updates: Mapping[str, SiteUpdate],
                  min_cosine: float, rnd: int = 1, directions: DirectionMemory | None = None) -> dict[str, str]:
    """Sites whose change of a shared part (:data:`SHARED_PARTS`) points against the other sites', with the reason.

    Each site's change (its part minus what it was sent) is compared with the coordinate-wise median
    of the other sites' changes of that part (:func:`direction_readings`); the round's cosines join the
    run's evidence (``directions``, :class:`DirectionMemory`; ``None``: this round's cosine alone), and an
    evidence below ``min_cosine`` marks the site. Needs :data:`MIN_SITES_FOR_DIRECTION` sites sending the
    part (three others, so that one site cannot carry their median), and a method whose shared parts are
    the sites' plain weighted mean (the catalogue's ``mean_aggregation``): Scaffold's control variates turn
    each site's change its own way (honest cosines down to -0.80 on cpu-small), so it is not judged by
    direction. A round that cannot be read (fewer sites, or no shared part) keeps out the sites whose
    evidence from the earlier rounds is below ``min_cosine`` (:func:`_standing_verdict`).
    """
    if min_cosine <= -1 or method.name not in mean_aggregation_methods():
        return {}
    cosines, sizes = direction_readings(method, state, updates) if len(updates) >= MIN_SITES_FOR_DIRECTION \
        else ({}, {})
    if not cosines:  # too few sites to read, or no shared part in the round (FedSM's last, statistics round)
        if directions is None:
            return {}
        directions.forget(rnd)  # an earlier attempt of this round with more sites no longer counts
        return _standing_verdict(directions, updates, min_cosine, rnd)
    memory = directions if directions is not None else DirectionMemory(0.0, 0.0)
    evidence = memory.observe(rnd, cosines, sizes)
    judged = memory.judged(rnd).get(rnd, {})
    reasons: dict[str, str] = {}
    for part, by_site in cosines.items():
        for site, cosine in by_site.items():
            judged_by = evidence[part].get(site)
            if judged_by is None or judged_by >= min_cosine or site in reasons:
                continue
            if not judged.get(part, True):
                why = (f"its evidence over the earlier rounds is {judged_by:.3f}; this round's cosine, {cosine:.3f}, "
                       "does not count: the sites' changes are small now or share no direction ([robust] "
                       "direction_min_change)")
            else:
                over = "" if judged_by == cosine else f", {judged_by:.3f} over the rounds so far"
                why = f"cosine {cosine:.3f} with the coordinate-wise median of their changes{over}"
            reasons[site] = (f"update rejected: the {part} update from {site} points against the other sites' "
                             f"({why}, below [robust] min_cosine = {min_cosine:g})")
            log.info("%s", reasons[site])
    return reasons


def _standing_verdict(directions: DirectionMemory, updates: Mapping[str, SiteUpdate], min_cosine: float,
                      rnd: int) -> dict[str, str]:
    """The sites of ``updates`` whose evidence from the earlier rounds is below ``min_cosine``, with the reason.

    A round that cannot be read (fewer than four sites, or no shared part: FedSM's last round carries each
    site's validation Dice, confidence histogram and style statistics, which set the routing threshold and
    the routing rule for every site) does not let a site left out by its direction back in.
    """
    reasons: dict[str, str] = {}
    for part, by_site in directions.evidence(rnd).items():
        for site, judged_by in by_site.items():
            if site in updates and judged_by < min_cosine and site not in reasons:
                reasons[site] = (f"update rejected: the {part} updates from {site} pointed against the other sites' "
                                 f"over the run (evidence {judged_by:.3f}, below [robust] min_cosine = "
                                 f"{min_cosine:g}); its answer to round {rnd} is not used either")
                log.info("%s", reasons[site])
    return reasons


def direction_readings(method: FederatedMethod, state: WeightSet, updates: Mapping[str, SiteUpdate]
                       ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """``({part: {site: cosine}}, {part: size})``: each site's change of a shared part against the others'
    coordinate-wise median, and the sites' median change size of the part.

    The median leaves the site itself out: with it in, the median takes the site's own value in a
    share of the coordinates, which lifts every site's cosine (cpu-small fundus: honest sites >= 0.25,
    and a flipped large site near 0 instead of negative). All sites' leave-one-out medians come from
    one sort per tensor (:func:`_leave_one_out_medians`), in float32, the lower middle value for an even
    count of others. A site that did not change the part, or a zero median, gives 1.0 (nothing to oppose).
    A site's change size is its norm per square root of its sample count, as :func:`clip_to_median`
    compares them.
    """
    references = {site: method.expected_update_shapes(state, site) for site in updates}
    out: dict[str, dict[str, float]] = {}
    sizes: dict[str, float] = {}
    for part in SHARED_PARTS:
        sites = [site for site, u in updates.items() if part in u.weights and part in references[site]]
        if len(sites) < MIN_SITES_FOR_DIRECTION:
            continue
        dots, own, median_sq = ([0.0] * len(sites) for _ in range(3))
        for key, ref in references[sites[0]][part].items():
            if not ref.dtype.is_floating_point:
                continue
            changes = torch.stack([(updates[site].weights[part][key].detach().float()
                                    - references[site][part][key].detach().float()).flatten() for site in sites])
            for i, median in enumerate(_leave_one_out_medians(changes)):
                change, median = changes[i].double(), median.double()
                dots[i] += float(change @ median)
                own[i] += float(change @ change)
                median_sq[i] += float(median @ median)
        out[part] = {site: dots[i] / math.sqrt(own[i] * median_sq[i]) if own[i] > 0 and median_sq[i] > 0 else 1.0
                     for i, site in enumerate(sites)}
        sizes[part] = statistics.median(math.sqrt(own[i] / max(updates[site].num_samples, 1))
                                        for i, site in enumerate(sites))
    return out, sizes


def _leave_one_out_medians(rows: torch.Tensor) -> list[torch.Tensor]:
    """For each row of ``rows`` (K, n), the coordinate-wise lower median of the other K - 1 rows.

    Sorted once: with the others' median at position ``j = (K - 2) // 2`` of their own order, a row
    whose rank in a coordinate is above ``j`` leaves ``sorted[j]`` as the median there, else ``sorted[j + 1]``.
    """
    k = rows.shape[0]
    ordered, order = torch.sort(rows, dim=0)
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(k).unsqueeze(1).expand_as(order))
    j = (k - 2) // 2
    return [torch.where(ranks[i] > j, ordered[j], ordered[j + 1]) for i in range(k)]


def clip_to_median(method: FederatedMethod, state: WeightSet, updates: Mapping[str, SiteUpdate],
                   factor: float, report: Callable[[str, str], None] | None = None) -> dict[str, SiteUpdate]:
    """Each model part's change (:data:`NORM_PARTS`, against what the site was sent) scaled down to at most
    ``factor`` times the round's median change of that part; the rest as it is.

    For the parts trained by local steps (:data:`STEP_PARTS`) the change is measured per square root of
    the site's sample count (``norm / sqrt(num_samples)``; a site's count is bounded by the
    :class:`UpdateScreen` before this runs), so a large honest site's longer walk is not read as an
    attack, while a ×5 site is held to about ``factor`` times its honest size. A part is judged only
    among the sites that sent it (every site sends the global model; each its own personalized model,
    against its own reference). With fewer than three sites the median is no consensus, and nothing is
    clipped. ``report(site, message)`` is told of every clip.
    """
    if factor <= 0 or len(updates) < 3:
        return dict(updates)
    references = {site: method.expected_update_shapes(state, site) for site in updates}
    out = dict(updates)
    root_n = {site: math.sqrt(max(u.num_samples, 1)) for site, u in updates.items()}
    for part in NORM_PARTS:
        per_size = part in STEP_PARTS
        norms = {site: _change_norm(u.weights[part], references[site][part]) / (root_n[site] if per_size else 1.0)
                 for site, u in updates.items() if part in u.weights and part in references[site]}
        if len(norms) < 3:
            continue
        bound = factor * statistics.median(norms.values())
        for site, norm in norms.items():
            if norm > bound and norm > 0:
                per = " for its sample count" if per_size else ""
                message = (f"the {part} update from {site} changes the model {norm / bound * factor:.3g} times as "
                           f"much as the round's median site{per}; clipped to {factor:g} x the median "
                           "([robust] clip)")
                log.info("%s", message)
                if report is not None:
                    report(site, message)
                weights = dict(out[site].weights)
                weights[part] = _clipped(weights[part], references[site][part], bound / norm)
                out[site] = replace(out[site], weights=weights)
    return out


def _aggregate(method: FederatedMethod, state: WeightSet, rnd: int, updates: Mapping[str, SiteUpdate],
               settings: RobustSettings | None) -> WeightSet:
    new = method.aggregate(state, rnd, updates)
    if settings is None or settings.aggregation == "mean" or method.name not in mean_aggregation_methods():
        return new
    for part in ("global", "selector"):
        parts = [u.weights[part] for u in updates.values() if part in u.weights]
        if parts and len(parts) == len(updates) and part in new:
            new[part] = coordinate_wise(parts, settings.aggregation, settings.trim)
    return new


def coordinate_wise(parts: list[Mapping[str, torch.Tensor]], how: str, trim: float = 0.2) -> dict[str, torch.Tensor]:
    """Coordinate-wise ``"median"`` or ``"trimmed_mean"`` of the sites' weights (floating keys; others from the first).

    The median of an even number of values is the mean of the two middle ones. The trimmed
    mean drops ``floor(trim * K)`` values at each end of every coordinate (none for K < 3).
    """
    if not parts:
        raise WeightsError("robust aggregation needs at least one update")
    out = {}
    k = len(parts)
    cut = math.floor(trim * k) if k >= 3 else 0
    for key, first in parts[0].items():
        if not first.dtype.is_floating_point:
            out[key] = first.clone()
            continue
        stacked = torch.stack([p[key].to(torch.float64) for p in parts])
        ordered = torch.sort(stacked, dim=0).values
        if how == "median":
            value = ordered[(k - 1) // 2] if k % 2 else (ordered[k // 2 - 1] + ordered[k // 2]) / 2
        elif how == "trimmed_mean":
            value = ordered[cut:k - cut].mean(dim=0)
        else:
            raise ConfigError(f"unknown robust aggregation {how!r}; use one of {list(AGGREGATIONS)}")
        out[key] = value.to(first.dtype)
    return out
