"""``results.md`` and its plots, regenerated from the cached benchmark results.

The markdown states the command, preset and seeds beside the tables, lists what did not
complete, and derives its comparisons ("FedSM vs FedAvg: +0.012") from the numbers. Each table
says which machines ran the cached jobs behind it and when they finished (the jobs' own
provenance, not the invocation that regenerated the file). A hand-written reading between
``<!-- reading:start -->`` and ``<!-- reading:end -->`` in an existing file is kept when the file
is regenerated for the same preset (``preserve_reading``); a reading written for another preset's
numbers is dropped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from engine import catalogue
from engine.bench import plots, tables
from engine.bench.cache import JobKey, ResultCache
from engine.bench.fediod_bench import fediod_section
from engine.bench.plan import ALL_TASKS, machine_label, plan_jobs
from engine.bench.plots import Figures
from engine.bench.presets import BenchPreset
from engine.bench.split_table import split_section
from engine.bench.tuning import TAKES_FEDAVG_RATE, chosen_lrs, tuning_table
from engine.data.synth import site_profiles, split_counts
from engine.io.atomic import write_text_atomic
from engine.tasks import get_task

READING_START, READING_END = "<!-- reading:start -->", "<!-- reading:end -->"
DEFAULT_READING = "_No reading written yet: add one between the reading markers; regeneration keeps it._"
#: A hand-written study kept whatever preset regenerates the file (it names its own commands and numbers).
RECIPE_START, RECIPE_END = "<!-- recipe:start -->", "<!-- recipe:end -->"
T = tables.METHOD_TITLES



def _paired_methods() -> list[tuple[str, str]]:
    """``(method, baseline)`` pairs the main table's paired differences report: each method against the ones
    its catalogue entry names, FedSM's family (the methods whose bundles route) first."""
    names = catalogue.method_names()
    routed = [n for n in names if catalogue.method(n).routing in ("gamma", "argmax")]
    return [(a, b) for a in [*routed, *(n for n in names if n not in routed)]
            for b in catalogue.method(a).compared_with]

def collect_docs(cache: ResultCache, preset: BenchPreset,
                 settings_for: Callable[[JobKey], dict[str, Any]]) -> dict[JobKey, dict[str, Any]]:
    """Cache documents (settings, result, provenance) of the preset's planned jobs whose settings match."""
    out: dict[JobKey, dict[str, Any]] = {}
    for key in plan_jobs(preset):
        doc = cache.load(key, settings_for(key))
        if doc is not None:
            out[key] = doc
    return out


def collect(cache: ResultCache, preset: BenchPreset,
            settings_for: Callable[[JobKey], dict[str, Any]]) -> dict[JobKey, dict[str, Any]]:
    """Results of the preset's planned jobs whose settings match."""
    return {k: doc["result"] for k, doc in collect_docs(cache, preset, settings_for).items()}


def provenance_summary(keys: Iterable[JobKey], docs: Mapping[JobKey, dict[str, Any]]) -> dict[str, Any]:
    """Where and when the cached jobs ``keys`` ran.

    Returns ``{"jobs", "machines": {label: jobs}, "unrecorded": jobs without a machine, "first",
    "last": ISO finish times, "untimed": jobs without a finish time}``.
    """
    used = [docs[k] for k in dict.fromkeys(keys) if k in docs]
    recorded = [(d.get("provenance") or {}) for d in used]
    machines = Counter(machine_label(p["machine"]) for p in recorded if p.get("machine"))
    times = sorted(p["finished"] for p in recorded if p.get("finished"))
    return {"jobs": len(used), "machines": dict(machines), "unrecorded": len(used) - sum(machines.values()),
            "first": times[0] if times else None, "last": times[-1] if times else None,
            "untimed": len(used) - len(times)}


def _where_when(p: dict[str, Any]) -> tuple[str, str]:
    if len(p["machines"]) == 1 and not p["unrecorded"]:
        where = f"run on {next(iter(p['machines']))}"
    else:
        parts = [f"{label} ({n} job(s))" for label, n in p["machines"].items()]
        if p["unrecorded"]:
            parts.append(f"machine not recorded ({p['unrecorded']} job(s))")
        where = (f"run on {len(p['machines'])} different machines: " if len(p["machines"]) > 1 else "run on ") \
            + "; ".join(parts)
    if p["first"] is None:
        when = "finish times not recorded"
    elif p["first"] == p["last"]:
        when = f"finished {p['first']}"
    else:
        when = f"finished between {p['first']} and {p['last']}"
    if p["first"] is not None and p["untimed"]:
        when += f" ({p['untimed']} without a recorded time)"
    return where, when


def provenance_line(keys: Iterable[JobKey], docs: Mapping[JobKey, dict[str, Any]] | None,
                    what: str = "this table") -> list[str]:
    """``["", "_Jobs behind this table: N, run on MACHINE; finished between A and B._"]`` (nothing if no job)."""
    if docs is None:
        return []
    p = provenance_summary(keys, docs)
    if not p["jobs"]:
        return []
    where, when = _where_when(p)
    return ["", f"_Jobs behind {what}: {p['jobs']}, {where}; {when}._"]


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *["| " + " | ".join(r) + " |" for r in rows]]


def _ms(t: tuple[float, float, int], digits: int = 4) -> str:
    return tables.fmt(t[0], t[1], t[2], digits)


def _diff(d: dict[str, Any]) -> str:
    if d["n"] == 0:
        return "not measured"
    if d["higher"] == d["n"]:
        verdict = f"higher in all {d['n']} seeds"
    elif d["lower"] == d["n"]:
        verdict = f"lower in all {d['n']} seeds"
    else:
        verdict = f"higher in {d['higher']}, lower in {d['lower']} of {d['n']} seeds"
    return f"{d['mean']:+.4f} ± {d['std']:.4f} ({verdict})"


def _main_section(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str,
                  figures: Figures,
                  docs: Mapping[JobKey, dict[str, Any]] | None = None) -> list[str]:
    tp = preset.task(task_name)
    task = get_task(task_name)
    labels = list(task.label_names)
    rows = tables.main_rows(results, task_name, preset.methods, labels)
    lines = [f"### {task_name}: client-average test Dice (mean ± std over seeds)", ""]
    header = ["method", *(labels if len(labels) > 1 else []), "mean" if len(labels) > 1 else "Dice", "pooled",
              "paper (client avg)", "seeds", "wall s / run"]
    body = []
    for r in rows:
        cells = [T.get(r["method"], r["method"])]
        cells += [_ms(r[lab]) for lab in labels] if len(labels) > 1 else []
        cells += [_ms(r["mean"]), _ms(r["pooled"]), f"{r['paper']:.4f}" if r["paper"] else "—",
                  ", ".join(map(str, r["seeds"])) or "none", tables.fmt(r["wall_s"][0], digits=0)]
        body.append(cells)
    lines += _table(header, body)
    lines += provenance_line([k for k in results if k.task == task_name and k.analysis == "main"], docs,
                             "this section's tables and plots")
    by = {r["method"]: r for r in rows}
    lines += ["", "Paired differences in client-average mean Dice (same data and seed; mean ± std over seeds):", ""]
    for a, b in _paired_methods():
        if a in by and b in by:
            lines.append(f"- {T[a]} − {T[b]}: {_diff(tables.paired_difference(results, task_name, a, b))}")
    lines += _best_round_lines(results, preset, task_name)
    lines += _rule_lines(results, preset, task_name)
    sites, site_rows = tables.per_site_rows(results, task_name, preset.methods)
    if site_rows:
        lines += ["", f"Per-site test Dice ({task_name}, mean over structures and seeds):", ""]
        lines += _table(["method", *sites],
                        [[T.get(r["method"], r["method"]), *[tables.fmt(r[s][0]) for s in sites]] for r in site_rows])
    detail = tables.fedsm_detail_rows(results, task_name)
    if detail:
        lines += ["", f"FedSM components ({task_name}): selector accuracy on held-out images of participating sites, "
                      "share of test images routed to the site's own model and to the global model, and Dice of "
                      "the routed super model, the global model alone and each site's personalized model on its "
                      "own site (oracle routing); the rule that picked each image's site, runs per rule "
                      "(FedSM's `site_routing` auto keeps the one that sent more validation images to their own "
                      "site's model; FedSM-extra routes by its selector's argmax).", ""]
        lines += _table(["method", "selector acc.", "routed to own", "routed to global", "routed Dice",
                         "global alone", "personalized (oracle)", "site picked by"],
                        [[T[r["method"]], _ms(r["selector_accuracy"], 3), _ms(r["own_share"], 2),
                          _ms(r["global_share"], 2), _ms(r["routed"]), _ms(r["global_only"]), _ms(r["oracle"]),
                          r["rule"]]
                         for r in detail])
    traffic = [r for r in rows if r["received"][2]]
    if traffic:
        lines += ["", f"Traffic per site per round ({task_name}, mean over rounds incl. calibration/selector "
                      "rounds):", ""]
        lines += _table(["method", "received", "sent"],
                        [[T.get(r["method"], r["method"]), _mib(r["received"][0]), _mib(r["sent"][0])]
                         for r in traffic])
    rel = figures.place(f"main-{task_name}.png", lambda path: plots.plot_bars(
        rows, "mean", T, f"{task_name} ({tp.sites} sites, {tp.image_size} px, {tp.rounds} rounds)",
        "client-average test Dice", path, tables.PAPER_CLIENT_AVERAGE.get(task_name)))
    if rel:
        lines += ["", f"![{task_name} main comparison]({rel})"]
    curves = tables.curve_series(results, task_name, preset.methods)
    losses = tables.loss_series(results, task_name, preset.methods)
    rel = figures.place(f"curves-{task_name}.png", lambda path: plots.plot_curves(curves, losses, T, task_name, path))
    if rel:
        lines += ["", "Training curves (the paper's Figure 2 analogue; mean over seeds):", "",
                  f"![{task_name} training curves]({rel})"]
    return lines


def _best_round_lines(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str) -> list[str]:
    """Per-seed FedSM differences at each method's best round, and the plateau criterion per method."""
    tp = preset.task(task_name)
    lines: list[str] = []
    pairs = [(a, b) for a, b in (("fedsm", "fedavg"), ("fedsm", "centralized"))
             if tables.paired_per_seed(results, task_name, a, b)]
    if pairs and preset.keep_best:
        lines += ["", "Per seed, at each method's best round by validation Dice (test Dice; rounds in brackets):",
                  ""]
        for a, b in pairs:
            cells = [f"seed {s}: {v['diff']:+.4f} (rounds {v['rounds'][0]} / {v['rounds'][1]})"
                     for s, v in tables.paired_per_seed(results, task_name, a, b).items()]
            lines.append(f"- {T[a]} − {T[b]}: " + "; ".join(cells))
    rows = tables.plateau_rows(results, task_name, preset.methods, tp.rounds, preset.plateau_share,
                               preset.plateau_tolerance)
    if rows and any(r["per_seed"] and any(c["points"] for c in r["per_seed"].values()) for r in rows):
        first = int(tp.rounds * (1 - preset.plateau_share)) + 1
        lines += ["", f"Plateau criterion ({task_name}): validation Dice (client average; Local: each site's model "
                      f"on its own site) flat within {preset.plateau_tolerance} (max − min) over rounds "
                      f"{first}–{tp.rounds}, the last {preset.plateau_share:.0%} of the training rounds:", ""]
        body = []
        for r in rows:
            seeds = "; ".join(
                f"seed {s}: span {c['span']:.4f}" + ("" if c["flat"] is None else (" flat" if c["flat"] else
                                                                                  " NOT flat"))
                + (f", best round {c['best_round']}" if c.get("best_round") is not None else "")
                for s, c in r["per_seed"].items())
            verdict = "not measured" if r["flat"] is None else ("plateaued" if r["flat"] else "NOT plateaued")
            body.append([T.get(r["method"], r["method"]), verdict, seeds])
        lines += _table(["method", "verdict", "per seed"], body)
    return lines


def _rule_lines(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str) -> list[str]:
    """FedSM with every personalization rule, each under the full routing path, paired per seed with
    FedAvg and Centralized at each method's best round."""
    rows = [r for r in tables.rule_paired_rows(results, task_name, preset.personalizations)
            if r["vs_fedavg"] or r["vs_centralized"]]
    if len(rows) < 2:  # SoftPull alone is the main table's FedSM row
        return []

    def per_seed(d: dict[int, float]) -> str:
        return " / ".join(f"{v:+.4f}" for v in d.values()) if d else "—"

    lines = ["", f"FedSM per personalization rule ({task_name}): every rule trains and routes through the same path "
                 "(reference selector, style gate, `auto` site routing, routing guard, best round by validation); "
                 "routed test Dice, and per seed (in seed order) FedSM − FedAvg and FedSM − Centralized, each at its "
                 "best round; the share of test images routed to their own site's model.", ""]
    lines += _table(["personalization", "routed Dice", "− FedAvg per seed", "− Centralized per seed",
                     "best rounds", "routed to own", "seeds"],
                    [[r["rule"], _ms(r["routed"]), per_seed(r["vs_fedavg"]), per_seed(r["vs_centralized"]),
                      " / ".join(str(v) for v in r["best_round"].values()), _ms(r["own_share"], 2),
                      ", ".join(map(str, r["seeds"]))] for r in rows])
    return lines


def _rule_choice_lines(results: dict[JobKey, dict[str, Any]], preset: BenchPreset) -> list[str]:
    """Which personalization rule the evidence favours over all tasks (:func:`tables.choose_rule`)."""
    if not preset.personalizations:
        return []
    choice = tables.choose_rule(results, [tp.task for tp in preset.tasks], preset.personalizations)
    if not choice["ranked"]:
        return []
    lines = ["", "### Personalization rule chosen by the evidence", "",
             "Rules ranked by the mean over tasks of their mean per-seed FedSM − FedAvg (client-average test Dice, "
             "each method at its best round); *meets*: above FedAvg on every fundus seed and within "
             f"{tables.PROSTATE_MARGIN} of it on every prostate seed. Only rules measured on every task and seed "
             "are ranked.", ""]
    lines += _table(["rule", "score", *[f"{t} mean − FedAvg" for t in [tp.task for tp in preset.tasks]], "meets"],
                    [[r["rule"], f"{r['score']:+.4f}", *[f"{r['per_task'][tp.task]:+.4f}" for tp in preset.tasks],
                      "yes" if r["meets"] else "no"] for r in choice["ranked"]])
    return lines


def _tuning_lines(results: dict[JobKey, dict[str, Any]], preset: BenchPreset) -> list[str]:
    """The learning rate each method ran with, and the validation Dice of every candidate (tuning)."""
    if not preset.lr_grid:
        return []

    lines = [f"- Learning rate per method chosen on validation Dice from {list(preset.lr_grid)} "
             f"(same rounds and seed for every candidate):"]
    for tp in preset.tasks:
        table = tuning_table(results, tp.task)
        chosen = chosen_lrs(results, tp.task, preset)
        for method, lrs in table.items():
            cells = ", ".join(f"{lr:g}: {d:.4f}" for lr, d in sorted(lrs.items()))
            lines.append(f"  - {tp.task} {T.get(method, method)}: chose {chosen.get(method, preset.lr):g} "
                         f"(best validation Dice per lr: {cells})")
    sharing = [T.get(m, m) for m in preset.methods if m in TAKES_FEDAVG_RATE]
    if sharing:
        lines.append(f"  - {', '.join(sharing)}: FedAvg's rate, not tuned on their own (their global model is "
                     "FedAvg's, trained on the same batches; docs/architecture.md)")
    return lines


def _time_section(results: dict[JobKey, dict[str, Any]], preset: BenchPreset) -> list[str]:
    """Where the time went: per task, method and analysis, job seconds and the validation share."""
    lines = ["## Where the time goes", "",
             "Job wall time per task, analysis and method (summed over seeds); `validation` is the time spent "
             "scoring every round on the validation split to keep the best round.", ""]
    any_rows = False
    for tp in preset.tasks:
        rows = tables.time_rows(results, tp.task)
        if not rows:
            continue
        any_rows = True
        total = sum(r["wall_s"] for r in rows)
        lines += [f"{tp.task}: {total:.0f} s in {sum(r['jobs'] for r in rows)} jobs", ""]
        lines += _table(["analysis", "method", "jobs", "wall s", "share", "validation s"],
                        [[r["analysis"], T.get(r["method"], r["method"]), str(r["jobs"]), f"{r['wall_s']:.0f}",
                          f"{r['share']:.0%}", f"{r['validation_s']:.0f}"] for r in rows])
        lines.append("")
    return lines if any_rows else []


def _lam_used(row: dict[str, Any]) -> str:
    text = ", ".join(f"{v:.3f}" for v in row["lam_used"])
    if any(v < row["one_over_k"] - 1e-9 for v in row["lam_used"]):
        text += " (< 1/K)"
    elif any(abs(v - row["one_over_k"]) < 1e-9 for v in row["lam_used"]):
        text += " (= 1/K)"
    return text if row["seeds"] else f"{text} (planned)"


def _analysis_sections(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str,
                       figures: Figures,
                       docs: Mapping[JobKey, dict[str, Any]] | None = None) -> list[str]:
    tp = preset.task(task_name)
    lines: list[str] = []
    # lam sweep
    lam = tables.lam_rows(results, task_name, tp.lam, tp.sites, preset.lam_values, preset.analysis_seeds)
    one_over_k = 1 / tp.sites
    lines += ["", f"### {task_name}: SoftPull lam sweep (the paper's Table 7)", "",
              f"FedSM trained with each requested lam, used as given also below 1/K = {one_over_k:.3f} (K = "
              f"{tp.sites} sites), as the paper's Table 7 sweeps 0.1–0.9 with 6 sites: SoftPull stays a convex "
              "combination, and below 1/K each other site's model weighs more than the site's own. "
              "(`fedsm simulate` and the main runs accept only lam ≥ 1/K; a requested lam equal to the main runs' "
              f"lam, {tables.fmt(max(tp.lam, one_over_k), digits=3)}, is read from the main FedSM runs.) "
              f"\"lam used\" is the value SoftPull used, as recorded by the runs; seeds "
              f"{', '.join(map(str, preset.analysis_seeds))}.", ""]
    lines += _table(["lam requested", "lam used", "routed Dice", "personalized (oracle)", "global alone", "seeds"],
                    [[f"{r['lam']:.2f}", _lam_used(r), _ms(r["routed"]), _ms(r["oracle"]),
                      _ms(r["global_only"]), ", ".join(map(str, r["seeds"])) or "not run"] for r in lam])
    lines += provenance_line([k for r in lam for k in r["keys"]], docs)
    rel = figures.place(f"lam-{task_name}.png", lambda path: plots.plot_lam(lam, task_name, path))
    if rel:
        lines += ["", f"![{task_name} lam sweep]({rel})"]
    # gamma, participating sites (main runs) and unseen site
    sweeps = [r["gamma_sweep"] for k, r in results.items()
              if k.task == task_name and k.analysis == "main" and k.method == "fedsm" and "gamma_sweep" in r]
    part = tables.gamma_rows(sweeps, own=True)
    unseen = tables.unseen_summary(results, task_name)
    lines += ["", f"### {task_name}: gamma and the unseen site (the paper's Tables 5 and 12)", ""]
    if part:
        lines += [f"Participating sites (main FedSM runs, {len(sweeps)} seed(s)): routed test Dice and routing "
                  "shares against gamma.", ""]
        lines += _table(["gamma", "routed Dice", "routed to global", "routed to own model"],
                        [[f"{r['gamma']:.2f}", _ms(r["dice"]), _ms(r["global_share"], 2), _ms(r["own_share"], 2)]
                         for r in part])
    if unseen.get("unseen_rows"):
        site, models = unseen["site"], unseen["models"]
        lines += ["", f"Unseen site: FedSM trained on the other {tp.sites - 1} sites, tested on {site} "
                      f"(seeds {', '.join(map(str, unseen['seeds']))}). Routed Dice and routing frequency per model:",
                  ""]
        lines += _table(["gamma", f"Dice on {site}", *models],
                        [[f"{r['gamma']:.2f}", _ms(r["dice"]), *[f"{r['routing'][m]:.2f}" for m in models]]
                         for r in unseen["unseen_rows"]])
        best = max(unseen["per_model"].items(), key=lambda kv: kv[1])
        alone = ", ".join(f"{m} {v:.4f}" for m, v in unseen["per_model"].items())
        lines += ["", f"Each model alone on {site}: {alone}"
                  + f" (best: {best[0]}). FedAvg trained on the same {tp.sites - 1} sites: "
                  f"{_ms(unseen['fedavg'])}. Mean selector confidence on {site}: {_ms(unseen['confidence'], 3)}; "
                  "argmax site share: " + ", ".join(f"{m} {v:.2f}" for m, v in unseen["argmax"].items()) + "."]
        if unseen.get("participating_rows"):
            lines += ["", f"Same {tp.sites - 1}-site super model on its participating sites:", ""]
            lines += _table(["gamma", "routed Dice", "routed to global", "routed to own model"],
                            [[f"{r['gamma']:.2f}", _ms(r["dice"]), _ms(r["global_share"], 2),
                              _ms(r["own_share"], 2)] for r in unseen["participating_rows"]])
    elif not part:
        lines += ["Not run or not completed."]
    lines += provenance_line([k for k in results if k.task == task_name and (
        (k.analysis == "main" and k.method == "fedsm") or k.analysis == "unseen")], docs, "this section's tables")
    rel = figures.place(f"gamma-{task_name}.png", lambda path: plots.plot_gamma(
        part, unseen.get("unseen_rows", []), unseen.get("site"), task_name, path))
    if rel:
        lines += ["", f"![{task_name} gamma]({rel})"]
    # personalization alternatives
    pers = tables.personalization_rows(results, task_name, preset.personalizations, preset.rule_seeds)
    lines += ["", f"### {task_name}: personalization inside FedSM (the paper's Table 6)", "",
              "Global model (FedAvg) and selector trained as in FedSM; only the personalized models differ. Every "
              "row routes the same way: reference selector, site-style gate, `auto` site routing and the routing "
              "guard, which each rule's sites feed with their personalized model's validation Dice (SoftPull's "
              "row is the main FedSM run). The oracle column is each site's personalized model on its own test "
              "images. Hyper-parameters: `engine/fl/personalization.py` (`PersonalizationConfig` defaults).", ""]
    lines += _table(["personalization", "routed Dice", "personalized (oracle)", "global alone", "selector acc.",
                     "wall s", "seeds"],
                    [[T.get(r["method"], r["method"]), _ms(r["routed"]), _ms(r["oracle"]), _ms(r["global_only"]),
                      _ms(r["selector_accuracy"], 3), tables.fmt(r["wall_s"][0], digits=0),
                      ", ".join(map(str, r["seeds"])) or "not run"] for r in pers])
    lines += provenance_line([k for r in pers for k in r["keys"]], docs)
    rel = figures.place(f"personalization-{task_name}.png", lambda path: plots.plot_bars(
        pers, "routed", T, f"{task_name}: personalization inside FedSM", "routed Dice", path))
    if rel:
        lines += ["", f"![{task_name} personalization]({rel})"]
    return lines


def _perf_section(results: dict[JobKey, dict[str, Any]],
                  docs: Mapping[JobKey, dict[str, Any]] | None = None) -> list[str]:
    perf_key = next((k for k in results if k.analysis == "perf"), None)
    perf = results[perf_key] if perf_key is not None else None
    lines = ["", "## Speed, traffic and memory", ""]
    if perf is None:
        return [*lines, "Not run or not completed."]
    th, inf, tr, mem, cuda = (perf.get(k, {}) for k in ("throughput_cpu", "routed_inference_cpu", "traffic",
                                                         "memory_cpu", "cuda"))
    lines += _table(["figure", "value", "ratio"], [
        [f"FedSM site round, engine vs hand-written loop ({th.get('image_size')} px, batch {th.get('batch_size')}, "
         f"{th.get('device')})",
         f"{th.get('engine_images_per_s', float('nan')):.1f} vs {th.get('hand_images_per_s', float('nan')):.1f} img/s",
         f"{th.get('ratio', float('nan')):.3f} (target ≥ 0.95)"],
        ["same, against the hand-written loop given the engine's fused Adam kernel too",
         f"{th.get('engine_images_per_s', float('nan')):.1f} vs "
         f"{th.get('hand_fused_images_per_s', float('nan')):.1f} img/s",
         f"{th.get('ratio_vs_fused_hand', float('nan')):.3f}"],
        [f"routed inference vs selector + all {inf.get('models')} U-Nets ({inf.get('image_size')} px, "
         f"{inf.get('device', 'device not recorded')})",
         f"{1e3 * inf.get('routed_s_per_image', float('nan')):.1f} vs "
         f"{1e3 * inf.get('all_models_s_per_image', float('nan')):.1f} ms/img",
         f"{inf.get('ratio', float('nan')):.3f}"],
        ["bytes per site per round, each way: FedSM vs FedAvg (fundus U-Net)",
         f"{_mib(tr.get('fedsm_bytes_each_way', 0))} vs {_mib(tr.get('fedavg_bytes_each_way', 0))}",
         f"{tr.get('fedsm_over_fedavg', float('nan')):.2f}"],
        ["bytes per site per round, each way: pooled selector head vs classic VGG-11 head",
         f"{_mib(tr.get('fedsm_bytes_each_way', 0))} vs {_mib(tr.get('fedsm_classic_head_bytes_each_way', 0))}",
         f"{tr.get('gap_over_classic', float('nan')):.3f}"],
        ["FedSM-extra selector round, bytes to each site (selector + K+1 U-Nets)",
         _mib(tr.get("fedsm_extra_selector_round_bytes_down", 0)), "—"],
        ["peak resident memory during one site round: FedSM vs FedAvg (increase over the process before the "
         "round in brackets)",
         f"{_num(mem, 'fedsm', 'round_peak_rss_mib', 0)} vs {_num(mem, 'fedavg', 'round_peak_rss_mib', 0)} MiB "
         f"(+{_num(mem, 'fedsm', 'round_rss_increase_mib', 0)} vs +{_num(mem, 'fedavg', 'round_rss_increase_mib', 0)})",
         f"{mem.get('fedsm_over_fedavg_round_peak_rss', float('nan')):.2f} (increase: "
         f"{mem.get('fedsm_over_fedavg_round_increase', float('nan')):.2f})"],
        ["peak Python-heap allocations during the round (tracemalloc; numpy, not torch): FedSM vs FedAvg",
         f"+{_num(mem, 'fedsm', 'round_tracemalloc_increase_mib', 1)} vs "
         f"+{_num(mem, 'fedavg', 'round_tracemalloc_increase_mib', 1)} MiB", "—"],
    ])
    if mem.get("measured") is False:
        lines += ["", f"Peak memory: {mem['reason']}."]
    if cuda.get("measured"):
        ct = cuda["throughput"]
        lines += ["", f"CUDA ({cuda['gpu']}, mixed precision): engine vs hand-written loop "
                      f"{ct['engine_images_per_s']:.1f} vs {ct['hand_images_per_s']:.1f} img/s "
                      f"(ratio {ct['ratio']:.3f}); "
                      f"peak GPU memory FedSM {cuda['fedsm']['peak_gpu_mib']:.0f} MiB vs FedAvg "
                      f"{cuda['fedavg']['peak_gpu_mib']:.0f} MiB (ratio {cuda['fedsm_over_fedavg_gpu_memory']:.2f})."]
    else:
        lines += ["", f"CUDA with mixed precision: {cuda.get('reason', 'not measured')}."]
    lines += ["", "Throughput repeats (s per round), engine: " + ", ".join(f"{x:.2f}" for x in th.get("engine_s", []))
              + "; hand-written: " + ", ".join(f"{x:.2f}" for x in th.get("hand_s", [])) + "."]
    lines += provenance_line([perf_key], docs, "these figures")
    return lines


def _num(d: dict[str, Any], kind: str, key: str, digits: int) -> str:
    value = d.get(kind, {}).get(key)
    return "—" if value is None else f"{value:.{digits}f}"


def _site_size_lines(preset: BenchPreset) -> list[str]:
    """Cases per synthetic site and split (unequal like the paper's Table 1)."""
    lines = ["Synthetic sites (cases per site; training / validation / test cases; prostate cases are volumes "
             "whose slices are the samples):", ""]
    for tp in preset.tasks:
        parts = []
        for k, profile in enumerate(site_profiles(tp.task, tp.sites)):
            tr, va, te = split_counts(profile.cases)
            parts.append(f"site{k + 1} {profile.cases} ({tr}/{va}/{te})")
        lines.append(f"- {tp.task}: " + ", ".join(parts))
    return lines


_PRESET_HEADER = re.compile(r"^# Benchmark results: preset `([^`]+)`", re.M)


def _read_reading(path: Path, preset_name: str | None = None) -> str:
    """The hand-written reading of an existing ``results.md``; the default when there is none.

    With ``preset_name``, a reading of a file generated for another preset is not kept: it
    describes other numbers.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return DEFAULT_READING
    header = _PRESET_HEADER.search(text)
    if preset_name is not None and header is not None and header.group(1) != preset_name:
        return (f"_No reading for this preset yet (the previous file was generated for preset "
                f"`{header.group(1)}`; its reading was dropped)._")
    m = re.search(re.escape(READING_START) + r"\n?(.*?)\n?" + re.escape(READING_END), text, re.S)
    return m.group(1).strip() if m and m.group(1).strip() else DEFAULT_READING


def _read_recipe(path: Path) -> str | None:
    """The hand-written convergence-recipe section of an existing ``results.md`` (kept for every preset)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(re.escape(RECIPE_START) + r"\n?(.*?)\n?" + re.escape(RECIPE_END), text, re.S)
    return m.group(1).strip() if m and m.group(1).strip() else None


def _jobs_line(docs: Mapping[JobKey, dict[str, Any]] | None, results: Mapping[JobKey, Any]) -> str:
    if docs is None:
        return "- Jobs behind the tables: provenance not available."
    p = provenance_summary(list(results), docs)
    if not p["jobs"]:
        return "- Jobs behind the tables: none completed yet."
    where, when = _where_when(p)
    return (f"- Jobs behind the tables: {p['jobs']}, {when}; {where}. Each table below names the machines and "
            "time span of its own jobs.")


def render(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, meta: dict[str, Any],
           figures: Figures, reading: str = DEFAULT_READING,
           docs: Mapping[JobKey, dict[str, Any]] | None = None, recipe: str | None = None) -> str:
    """The whole markdown document.

    ``docs`` are the cache documents of ``results`` (for each job's machine and finish time);
    ``meta`` describes the invocation that regenerated the file.
    """
    machine, run = meta["machine"], meta["run"]
    planned = meta["planned"]
    done = {k.label for k in results}
    missing = [label for label in planned if label not in done]
    lines = [
        f"# Benchmark results: preset `{preset.name}`", "",
        "Generated by `fedsm bench` from the cached job results; do not edit by hand except between the "
        "reading markers.", "",
        "## How these numbers were made", "",
        _jobs_line(docs, results),
        f"- Latest invocation (regenerated this file): `{meta.get('command') or 'fedsm bench --preset ' + preset.name}`"
        f", finished {meta['finished']}; it ran {len(run['ran'])} job(s), reused "
        f"{len(run['cached'])} cached, {len(run['failed'])} failed, in {run.get('wall_s', 0):.0f} s, on "
        f"{machine_label(machine)}; load average at start {machine.get('load_average_at_start')}.",
        f"- Preset: {preset.description}.",
        f"- Seeds: main comparison {', '.join(map(str, preset.seeds))}; analyses "
        f"{', '.join(map(str, preset.analysis_seeds))}; "
        f"personalization rules {', '.join(map(str, preset.rule_seeds))}; "
        + (f"data seed {preset.data_seed} (the same synthetic data for every training seed; the seed changes "
           "initialisation and batch order)." if preset.data_seed is not None else
           "each training seed has its own synthetic data, generated with the same seed (seed 1 trains on data "
           "seed 1), so a finding that holds on every seed holds on three draws of the data."),
        f"- Training: {preset.epochs} local epoch(s) per round, batch {preset.batch_size}, Adam lr {preset.lr}, "
        f"selector width {preset.selector_width}, selector lr "
        f"{preset.selector_lr or 'default (reference scheme: 1e-3 at width 64, 3e-3 narrower; 1e-5 per-batch)'} on "
        f"{preset.selector_size} px inputs, gamma {preset.gamma}, FedProx mu "
        f"{preset.prox_mu}; U-Net lr schedule {preset.lr_schedule}"
        + (f" (down to {preset.lr_min_ratio} x lr)" if preset.lr_schedule == "cosine" else "")
        + f", loss {preset.loss}; "
        + ("each method evaluated at its best round by validation Dice." if preset.keep_best
           else "each method evaluated at its last round."),
        *_tuning_lines(results, preset),
        "",
        "| task | sites | image px | rounds | slices/volume | lam |",
        "|---|---|---|---|---|---|",
        *[f"| {t.task} | {t.sites} | {t.image_size} | {t.rounds} | {t.slices if t.task == 'prostate' else '—'} | "
          f"{t.lam} |" for t in preset.tasks],
        "",
        *_site_size_lines(preset),
        "",
        f"Jobs completed: {len(planned) - len(missing)} of {len(planned)}."
        + (" Not completed: " + "; ".join(missing) + "." if missing else ""),
    ]
    if run["failed"]:
        lines += ["", "Failed in this invocation: " + "; ".join(f"{k}: {v}" for k, v in run["failed"].items())]
    lines += ["", "## Reading", "", READING_START, reading, READING_END]
    if recipe:
        lines += ["", "## Convergence recipe", "", RECIPE_START, recipe, RECIPE_END]
    lines += ["", "## Main comparison (the paper's Table 3)",
              "", "Paper (client average, 6 real sites, 256 px, 150 rounds): retinal — Centralized 0.8898, FedAvg "
              "0.8710, FedProx 0.8434, Scaffold 0.8141, FedSM 0.8914, FedSM-extra 0.8905; prostate — Centralized "
              "0.8737, FedAvg 0.8684, FedSM 0.8763.", ""]
    for tp in preset.tasks:
        lines += _main_section(results, preset, tp.task, figures, docs)
        lines.append("")
    lines += _rule_choice_lines(results, preset)
    lines += ["", "## Analyses"]
    for tp in preset.tasks:
        lines += _analysis_sections(results, preset, tp.task, figures, docs)
    for tp in preset.tasks:
        lines += split_section(results, preset, tp.task)

    for tp in preset.tasks:
        section = fediod_section(results, preset, tp.task)
        if section:
            lines += section
            lines += provenance_line([k for k in results if k.task == tp.task and k.analysis == "fediod"], docs)
    lines += _perf_section(results, docs)
    lines += ["", *_time_section(results, preset)]
    lines += ["", "## Configuration", "", "```json", json.dumps(preset.to_json(), indent=1), "```", ""]
    return "\n".join(lines)


def write_report(cache: ResultCache, preset: BenchPreset, meta: dict[str, Any], out_dir: Path, *,
                 img_prefix: str = "img", img_dir: Path | None = None,
                 settings_for: Callable[[JobKey], dict[str, Any]], preserve_reading: bool = False,
                 figures_of: Figures | None = None) -> tuple[Path, Figures]:
    """Write ``out_dir/<preset.docs_file>`` (``results.md`` unless the preset names its own) and its PNG plots.

    ``figures_of``: the :class:`~engine.bench.plots.Figures` of a report of the same results written
    just before (the run's own report, when this one is the docs copy): its plots are copied, not
    drawn again. Returns the markdown file and this report's figures.
    """
    out_dir = Path(out_dir)
    img_dir = Path(img_dir) if img_dir is not None else out_dir / img_prefix
    img_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / preset.docs_file
    docs = collect_docs(cache, preset, settings_for)
    results = {k: doc["result"] for k, doc in docs.items()}
    figures = Figures(img_dir, img_prefix, drawn_by=figures_of)
    reading = _read_reading(target, preset.name) if preserve_reading else DEFAULT_READING
    recipe = _read_recipe(target) if preserve_reading else None
    write_text_atomic(target, render(results, preset, meta, figures, reading, docs, recipe))
    return target, figures


__all__ = ["ALL_TASKS", "collect", "collect_docs", "provenance_line", "provenance_summary", "render",
           "write_report"]
