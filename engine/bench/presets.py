"""Benchmark presets: which tasks, methods, seeds, rounds and analyses a ``fedsm bench`` run covers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine import catalogue
from engine.bundle.supermodel import DEFAULT_SELECTOR_WIDTH
from engine.errors import ConfigError

#: Methods of the BlackFed comparison (its paper's Tables 2-3), in table order.
SPLIT_METHODS = ("local", "blackfed-v1", "blackfed-v2", "split-whitebox", "fedavg", "centralized")

#: Methods of the main comparison (the paper's Table 3), in table order.
MAIN_METHODS = catalogue.method_names()


@dataclass(frozen=True)
class TaskPreset:
    """Data and training scale of one task inside a preset.

    Attributes
    ----------
    task
        ``"fundus"`` or ``"prostate"``.
    sites
        Number of synthetic sites (the paper has 6 per task, of unequal sizes).
    image_size
        Image side in pixels (multiple of 16).
    rounds
        Federated training rounds (FedSM adds a calibration round, FedSM-extra its selector rounds).
    slices
        Axial slices per synthetic prostate volume (ignored for fundus).
    lam
        SoftPull lam of the main FedSM runs (the paper's best per task).
    """

    task: str
    sites: int = 6
    image_size: int = 64
    rounds: int = 5
    slices: int = 12
    lam: float = 0.7


@dataclass(frozen=True)
class BenchPreset:
    """Everything a benchmark run covers; recorded beside every result.

    Attributes
    ----------
    seeds
        Training seeds of the main comparison.
    data_seed
        Seed of the synthetic data every job trains on; ``None``: each training seed has its own
        data, generated with the same seed (training seed and data seed move together), so a
        finding that holds on every seed is not a property of one draw of the data.
    lam_values
        SoftPull lam sweep (paper Table 7); trained as given, also below ``1/K``
        (:func:`engine.bench.bench_simulation.sweep_lam`).
    gammas
        Routing thresholds evaluated on participating and unseen sites (paper Tables 5, 12).
    unseen_site
        1-based index of the site left out of training for the unseen-site analysis.
    personalizations
        Alternatives to SoftPull trained inside FedSM (paper Table 6), each through FedSM's full
        routing path (reference selector, style gate, auto routing, guard, best round).
    personalization_seeds
        Seeds of the personalization runs; ``None``: the analysis seeds. A preset that compares
        the rules with FedAvg and Centralized seed by seed uses the main seeds.
    analysis_seeds
        Seeds of the lam sweep, unseen-site and personalization runs (the first also tunes the
        learning rates).
    unseen_analysis
        Whether the unseen-site analysis runs (paper Tables 5 and 12).
    perf
        Whether to measure speed, traffic and memory (:mod:`engine.bench.perf`).
    lr_schedule, lr_min_ratio, loss
        Training recipe (:class:`engine.fl.local_training.LocalTrainingConfig`).
    keep_best
        Evaluate each method at its best round by validation Dice (:mod:`engine.fl.model_selection`).
    lr_grid
        Learning rates tried per method on validation before the main comparison (empty: use ``lr``
        for every method); each candidate gets the same rounds (``tune_rounds``, default the task's)
        and seed (the first analysis seed), and the main runs use each method's best
        (:mod:`engine.bench.tuning`).
    plateau_share, plateau_tolerance
        Plateau criterion the report checks: validation Dice within ``plateau_tolerance``
        (max - min) over the last ``plateau_share`` of the training rounds.
    fediod_seeds, fediod_steps, fediod_epsilons, fediod_teacher_epochs
        The FedIOD analysis (:mod:`engine.bench.fediod_bench`): its seeds (none = skipped),
        distillation steps over the whole run, the epsilon targets of the Dice-vs-epsilon runs,
        and the teachers' epoch cap.
    """

    name: str
    tasks: tuple[TaskPreset, ...]
    methods: tuple[str, ...] = MAIN_METHODS
    seeds: tuple[int, ...] = (0, 1, 2)
    data_seed: int | None = 0
    epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-3
    selector_lr: float | None = None  # None: the reference selector's default for its width, 1e-5 per-batch
    selector_size: int = 32
    selector_width: int = DEFAULT_SELECTOR_WIDTH  # the selector's VGG-11 backbone width (the paper's 64)
    gamma: float = 0.6
    prox_mu: float = 0.01
    lam_values: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    gammas: tuple[float, ...] = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
    unseen_site: int = 6
    personalizations: tuple[str, ...] = ("finetune", "apfl", "perfedavg", "pfedme")
    analysis_seeds: tuple[int, ...] = (0,)
    personalization_seeds: tuple[int, ...] | None = None
    unseen_analysis: bool = True
    perf: bool = True
    perf_image_size: int = 64
    perf_batches: int = 6
    perf_repeats: int = 3
    perf_memory: bool = True
    fediod_seeds: tuple[int, ...] = ()
    fediod_steps: int = 120
    fediod_epsilons: tuple[float, ...] = ()
    fediod_teacher_epochs: int = 20
    #: File ``--docs`` writes in ``docs/`` (a preset with its own file does not replace results.md).
    docs_file: str = "results.md"
    description: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    lr_schedule: str = "constant"
    lr_min_ratio: float = 0.01
    loss: str = "dice"
    keep_best: bool = True
    lr_grid: tuple[float, ...] = ()
    tune_rounds: int | None = None
    plateau_share: float = 0.2
    plateau_tolerance: float = 0.01
    #: BlackFed comparison (:mod:`engine.bench.split_table`): its methods, seeds (empty = not run)
    #: and tasks; every method is evaluated at its last round there.
    split_methods: tuple[str, ...] = SPLIT_METHODS
    split_seeds: tuple[int, ...] = ()
    split_tasks: tuple[str, ...] = ("fundus",)

    def task(self, name: str) -> TaskPreset:
        """The :class:`TaskPreset` of task ``name``."""
        for t in self.tasks:
            if t.task == name:
                return t
        raise ConfigError(f"preset {self.name} has no task {name!r}")

    def data_seed_for(self, seed: int) -> int:
        """The data seed of a job trained with ``seed`` (see :attr:`data_seed`)."""
        return int(seed) if self.data_seed is None else int(self.data_seed)

    @property
    def rule_seeds(self) -> tuple[int, ...]:
        """Seeds of the personalization runs (:attr:`personalization_seeds`, else the analysis seeds)."""
        return self.analysis_seeds if self.personalization_seeds is None else self.personalization_seeds

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready dict (recorded in every cached result and in the report)."""
        d = asdict(self)
        d["tasks"] = [asdict(t) for t in self.tasks]
        return d


PRESETS: dict[str, BenchPreset] = {
    "tiny": BenchPreset(
        name="tiny",
        description="CI smoke test of the whole machinery: 3 small sites, 32 px, 1 round, 1 seed, a 16-wide "
                    "selector, four methods (seconds)",
        tasks=(TaskPreset("fundus", sites=3, image_size=32, rounds=1, lam=0.7),
               TaskPreset("prostate", sites=3, image_size=32, rounds=1, slices=6, lam=0.5)),
        # four of the seven methods: the bench machinery is the same for every method (each method's own training
        # is tests/fl's), and FedProx, Scaffold and FedSM-extra would add a third of the suite's longest test
        methods=("centralized", "local", "fedavg", "fedsm"),
        # one seed: the reduction over seeds is unit-tested (tests/bench/test_bench_units.py); a second seed
        # added a quarter of the suite's longest test
        seeds=(0,), batch_size=8, lam_values=(0.2,), gammas=(0.0, 0.6, 1.0), unseen_site=3,
        personalizations=("apfl",), analysis_seeds=(0,), selector_width=16,
        perf_image_size=32, perf_batches=1, perf_repeats=1, perf_memory=False,
    ),
    "cpu-small": BenchPreset(
        name="cpu-small",
        description="The full study at CPU scale: 6 sites of unequal size per task, 3 seeds, few rounds; BlackFed's "
                    "and FedIOD's tables (Dice and HD95, student Dice against epsilon) on seed 0",
        tasks=(TaskPreset("fundus", sites=6, image_size=48, rounds=6, lam=0.7),
               TaskPreset("prostate", sites=6, image_size=32, rounds=5, slices=6, lam=0.3)),
        seeds=(0, 1, 2), batch_size=8, split_seeds=(0,),
        fediod_seeds=(0,), fediod_steps=120, fediod_epsilons=(1.0, 8.0, 64.0), fediod_teacher_epochs=10,
    ),
    "blackfed": BenchPreset(
        name="blackfed",
        description="BlackFed's comparison alone (its paper's Tables 2-3 style): 4 fundus sites, 48 px, 6 rounds, "
                    "seed 0; every method evaluated at its last round",
        tasks=(TaskPreset("fundus", sites=4, image_size=48, rounds=6, lam=0.7),),
        methods=(), seeds=(), lam_values=(), personalizations=(), analysis_seeds=(), perf=False, keep_best=False,
        split_seeds=(0,),
    ),
    "cpu-converged": BenchPreset(
        name="cpu-converged",
        description="The full study trained to a plateau on a 2-core CPU: 6 sites per task, 64 px fundus for 60 "
                    "rounds, 32 px prostate for 150, Dice + cross-entropy loss, cosine learning-rate decay, best "
                    "round by validation, the learning rate of every method tuned on validation (FedSM's family "
                    "takes FedAvg's: its global model is FedAvg's) (docs/results.md, Convergence recipe)",
        tasks=(TaskPreset("fundus", sites=6, image_size=64, rounds=60, lam=0.7),
               TaskPreset("prostate", sites=6, image_size=32, rounds=150, slices=6, lam=0.3)),
        seeds=(0, 1, 2), batch_size=8, lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.01, loss="dicece",
        keep_best=True, lr_grid=(3e-4, 1e-3, 3e-3), tune_rounds=30, data_seed=None, personalization_seeds=(0, 1, 2),
    ),
    "paper": BenchPreset(
        name="paper",
        description="The paper's scale: 256 x 256, 150 rounds, 1 local epoch, the paper's VGG-11 selector (width "
                    "64); meant for a GPU",
        tasks=(TaskPreset("fundus", sites=6, image_size=256, rounds=150, lam=0.7),
               TaskPreset("prostate", sites=6, image_size=256, rounds=150, slices=12, lam=0.3)),
        seeds=(0, 1, 2), batch_size=8, analysis_seeds=(0, 1, 2), perf_image_size=256, selector_width=64,
        fediod_seeds=(0, 1, 2), fediod_steps=3000, fediod_epsilons=(1.0, 8.0, 64.0), fediod_teacher_epochs=100,
    ),
    "fediod-cpu": BenchPreset(
        name="fediod-cpu",
        description="FedIOD's tables alone at CPU scale: Table 2 shape (Standalone, Centralized, FedAvg, FedSM, "
                    "FedIOD; Dice and HD95) and student Dice against epsilon, 3 sites per task at 32 px, 1 seed",
        tasks=(TaskPreset("fundus", sites=3, image_size=32, rounds=4, lam=0.7),
               TaskPreset("prostate", sites=3, image_size=32, rounds=4, slices=6, lam=0.5)),
        methods=(), seeds=(), lam_values=(), personalizations=(), analysis_seeds=(), perf=False,
        fediod_seeds=(0,), fediod_steps=60, fediod_epsilons=(1.0, 8.0, 64.0), fediod_teacher_epochs=10,
        docs_file="results-fediod.md",
    ),
}


def get_preset(name: str) -> BenchPreset:
    """The preset called ``name``; :class:`ConfigError` names the choices otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown benchmark preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def restrict_preset(preset: BenchPreset, tasks: tuple[str, ...] | None = None, seeds: tuple[int, ...] | None = None,
                    main_only: bool = False, methods: tuple[str, ...] | None = None,
                    no_analyses: bool = False, rules_only: bool = False) -> BenchPreset:
    """A reduced copy of ``preset``: only ``tasks``, main-comparison ``seeds`` and ``methods``; ``main_only``
    also drops the performance figures, the learning-rate tuning and the analyses (lam sweep, unseen
    site, personalization); ``no_analyses`` drops only the analyses (and the BlackFed and FedIOD
    tables), keeping the speed figures and the learning-rate tuning of the main comparison;
    ``rules_only`` keeps the main comparison, its learning-rate tuning and the personalization
    rules, and drops the speed figures and the other analyses.

    The preset keeps its name and every training setting, so the results (and cache entries) are
    the full preset's for the jobs that run.
    """
    out = preset
    if tasks:
        unknown = [t for t in tasks if t not in {tp.task for tp in preset.tasks}]
        if unknown:
            raise ConfigError(f"preset {preset.name} has no task(s) {unknown}; it has "
                              f"{', '.join(tp.task for tp in preset.tasks)}")
        out = replace(out, tasks=tuple(tp for tp in preset.tasks if tp.task in tasks))
    if seeds:
        out = replace(out, seeds=tuple(seeds))
    if methods:
        unknown = [m for m in methods if m not in preset.methods]
        if unknown:
            raise ConfigError(f"preset {preset.name} has no method(s) {unknown}; it has {', '.join(preset.methods)}")
        out = replace(out, methods=tuple(m for m in preset.methods if m in methods))
    if seeds and out.personalization_seeds is not None:
        out = replace(out, personalization_seeds=tuple(s for s in out.personalization_seeds if s in seeds))
    if main_only:
        out = replace(out, perf=False, lr_grid=(), lam_values=(), personalizations=(), analysis_seeds=(),
                      fediod_seeds=())
    if no_analyses:
        out = replace(out, lam_values=(), personalizations=(), unseen_analysis=False, fediod_seeds=(),
                      split_seeds=())
    if rules_only:
        out = replace(out, perf=False, lam_values=(), unseen_analysis=False, fediod_seeds=(), split_seeds=())
    return out
