"""Benchmark tables: cached job results reduced to mean ± std over seeds, as markdown rows.

Every function takes the collected results ``{JobKey: result}`` and returns plain data
(``rows``) that :mod:`engine.bench.report` renders and :mod:`engine.bench.plots` draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from engine import catalogue
from engine.bench.bench_simulation import effective_lam, sweep_lam
from engine.bench.cache import JobKey
from engine.bench.plan import lam_label

Results = Mapping[JobKey, dict[str, Any]]

METHOD_TITLES = {**{name: catalogue.method(name).title for name in catalogue.method_names()},
                 "fedsm-finetune": "FedSM + local fine-tuning", "fedsm-apfl": "FedSM + APFL",
                 "fedsm-perfedavg": "FedSM + Per-FedAvg", "fedsm-pfedme": "FedSM + pFedMe",
                 "softpull": "FedSM + SoftPull (FedSM)"}

#: Client-average Dice the paper reports (Table 3: retinal = fundus, prostate).
PAPER_CLIENT_AVERAGE = {task: {name: catalogue.method(name).paper_dice[task] for name in catalogue.method_names()
                               if task in catalogue.method(name).paper_dice} for task in ("fundus", "prostate")}


def mean_std(values: Iterable[float | None]) -> tuple[float, float, int]:
    """Mean, sample std (0 for one value) and count of the finite values."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return float("nan"), float("nan"), 0
    return float(np.mean(vals)), float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0, len(vals)


def fmt(mean: float, std: float | None = None, n: int | None = None, digits: int = 4) -> str:
    """``0.8123 ± 0.0100`` (std omitted for one value); ``—`` when nothing was measured."""
    if mean is None or not math.isfinite(mean):
        return "—"
    if std is None or (n is not None and n < 2):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def mean_and_per_seed(values: list[float], digits: int = 4, signed: bool = False) -> str:
    """``**mean** (v0 / v1 / ...)``: a table cell of one figure over seeds (the value alone for one seed)."""
    form = f"{'+' if signed else ''}.{digits}f"
    per_seed = " / ".join(format(v, form) for v in values)
    return f"**{format(sum(values) / len(values), form)}** ({per_seed})" if len(values) > 1 else per_seed


def _select(results: Results, task: str, analysis: str, method: str | None = None) -> dict[int, dict[str, Any]]:
    return {k.seed: r for k, r in results.items()
            if k.task == task and k.analysis == analysis and (method is None or k.method == method)}


def _stat(runs: Mapping[int, dict[str, Any]], get: Callable[[dict[str, Any]], Any]) -> tuple[float, float, int]:
    vals = []
    for r in runs.values():
        try:
            vals.append(get(r))
        except (KeyError, TypeError, IndexError):
            continue
    return mean_std(vals)


def main_rows(results: Results, task: str, methods: Iterable[str], labels: list[str]) -> list[dict[str, Any]]:
    """Per method: client-average Dice per structure and mean, pooled, wall time, seeds."""
    rows = []
    for m in methods:
        runs = _select(results, task, "main", m)
        row: dict[str, Any] = {"method": m, "seeds": sorted(runs)}
        for lab in [*labels, "mean"]:
            row[lab] = _stat(runs, lambda r, lab=lab: r["client_average"][lab])
        row["pooled"] = _stat(runs, lambda r: r["pooled"]["mean"])
        row["wall_s"] = _stat(runs, lambda r: r["wall_s"])
        row["paper"] = PAPER_CLIENT_AVERAGE.get(task, {}).get(m)
        row["received"] = _stat(runs, lambda r: np.mean([v["received_mean"] for v in r["bytes_per_round"].values()]))
        row["sent"] = _stat(runs, lambda r: np.mean([v["sent_mean"] for v in r["bytes_per_round"].values()]))
        rows.append(row)
    return rows


def paired_difference(results: Results, task: str, a: str, b: str) -> dict[str, Any]:
    """Per-seed difference of client-average mean Dice ``a - b`` over the seeds both ran.

    Both methods see the same data and seed, so the per-seed difference removes most of the
    seed-to-seed spread that the methods share (initialisation, batch order).
    """
    ra, rb = _select(results, task, "main", a), _select(results, task, "main", b)
    diffs = [ra[s]["client_average"]["mean"] - rb[s]["client_average"]["mean"] for s in sorted(set(ra) & set(rb))]
    mean, std, n = mean_std(diffs)
    return {"mean": mean, "std": std, "n": n, "higher": sum(d > 0 for d in diffs), "lower": sum(d < 0 for d in diffs)}


def per_site_rows(results: Results, task: str, methods: Iterable[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Per method: each site's mean Dice (mean over seeds)."""
    sites: list[str] = []
    rows = []
    for m in methods:
        runs = _select(results, task, "main", m)
        if not runs:
            continue
        first = next(iter(runs.values()))
        sites = sites or list(first["dice"])
        rows.append({"method": m, **{s: _stat(runs, lambda r, s=s: r["dice"][s]["mean"]) for s in sites}})
    return sites, rows


def fedsm_detail_rows(results: Results, task: str) -> list[dict[str, Any]]:
    """FedSM / FedSM-extra: selector accuracy, share routed to own model / global, components."""
    rows = []
    for m in ("fedsm", "fedsm-extra"):
        runs = _select(results, task, "main", m)
        if not runs:
            continue

        def own_share(r: dict[str, Any]) -> float:
            routing = r["extra"]["routing"]
            return float(np.mean([freq[site] for site, freq in routing.items()]))

        rows.append({
            "method": m,
            "selector_accuracy": _stat(runs, lambda r: r["extra"]["selector_accuracy"]["overall"]),
            "own_share": _stat(runs, own_share),
            "global_share": _stat(runs, lambda r: np.mean([f["global"] for f in r["extra"]["routing"].values()])),
            "routed": _stat(runs, lambda r: r["client_average"]["mean"]),
            "global_only": _stat(runs, lambda r: r["extra"]["components"]["global_only"]["client_average"]["mean"]),
            "oracle": _stat(runs, lambda r: r["extra"]["components"]["personal_oracle"]["client_average"]["mean"]),
            "rule": routing_rules(runs.values()),
        })
    return rows


def routing_rules(runs: Any) -> str:
    """How FedSM's runs picked each image's site: e.g. ``"style 2, selector 1"`` (``site_routing`` auto's
    choice per run; runs without a recorded choice count as the selector, as their bundles route)."""
    counts: dict[str, int] = {}
    for r in runs:
        choice = r.get("extra", {}).get("selector", {}).get("routing_choice")
        rule = "style" if choice and choice.get("style") else "selector"
        counts[rule] = counts.get(rule, 0) + 1
    return ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def gamma_rows(sweeps: list[dict[str, Any]], own: bool) -> list[dict[str, Any]]:
    """Per gamma, over runs: client-average Dice and routing shares (global, own model)."""
    if not sweeps:
        return []
    rows = []
    for i, g in enumerate(sweeps[0]["gammas"]):
        gamma = g["gamma"]
        dice = mean_std([s["gammas"][i]["client_average"] for s in sweeps])
        glob = mean_std([np.mean([f["global"] for f in s["gammas"][i]["routing"].values()]) for s in sweeps])
        row = {"gamma": gamma, "dice": dice, "global_share": glob}
        if own:
            row["own_share"] = mean_std([np.mean([f[site] for site, f in s["gammas"][i]["routing"].items()])
                                         for s in sweeps])
        else:
            models = sweeps[0]["models"]
            row["routing"] = {m: mean_std([np.mean([f[m] for f in s["gammas"][i]["routing"].values()])
                                           for s in sweeps])[0] for m in models}
        rows.append(row)
    return rows


def lam_rows(results: Results, task: str, main_lam: float, sites: int, lam_values: Iterable[float],
             analysis_seeds: Iterable[int]) -> list[dict[str, Any]]:
    """Per requested lam: the lam SoftPull used, routed, oracle and global-only client-average Dice.

    Sweep values are trained as requested, also below ``1/K`` (:func:`engine.bench.bench_simulation.sweep_lam`);
    ``lam_used`` lists the distinct values the runs recorded (the planned value when none ran).
    A lam that equals the main runs' lam (raised to ``1/K``) is read from the main FedSM runs
    with the analysis seeds instead of being trained twice. ``keys`` are the jobs behind a row.
    """
    seeds = set(analysis_seeds)
    main_used = effective_lam(main_lam, sites)
    rows = []
    for lam in lam_values:
        planned = sweep_lam(lam)
        runs = _select(results, task, "lam", lam_label(lam))
        keys = [JobKey(task, "lam", lam_label(lam), s) for s in sorted(runs)]
        if not runs and abs(planned - main_used) < 1e-9:
            runs = {s: r for s, r in _select(results, task, "main", "fedsm").items() if s in seeds}
            keys = [JobKey(task, "main", "fedsm", s) for s in sorted(runs)]
        used = sorted({round(float(r["lam_used"] if "lam_used" in r else r["extra"]["lam"]), 9)
                       for r in runs.values() if "lam_used" in r or "lam" in r.get("extra", {})})
        rows.append({"lam": float(lam), "lam_used": used or [planned], "one_over_k": 1.0 / sites,
                     "seeds": sorted(runs), "keys": keys,
                     "routed": _stat(runs, lambda r: r["client_average"]["mean"]),
                     "oracle": _stat(runs, lambda r: r["extra"]["components"]["personal_oracle"]["client_average"]
                                     ["mean"]),
                     "global_only": _stat(runs, lambda r: r["extra"]["components"]["global_only"]["client_average"]
                                          ["mean"])})
    return rows


def personalization_rows(results: Results, task: str, kinds: Iterable[str],
                         analysis_seeds: Iterable[int]) -> list[dict[str, Any]]:
    """SoftPull (main FedSM with the analysis seeds) and each alternative."""
    seeds = set(analysis_seeds)
    entries = [("softpull", "main", "fedsm",
                {s: r for s, r in _select(results, task, "main", "fedsm").items() if s in seeds})]
    entries += [(f"fedsm-{k}", "personalization", f"fedsm-{k}",
                 _select(results, task, "personalization", f"fedsm-{k}")) for k in kinds]
    rows = []
    for name, analysis, method, runs in entries:
        rows.append({"method": name, "seeds": sorted(runs),
                     "keys": [JobKey(task, analysis, method, s) for s in sorted(runs)],
                     "routed": _stat(runs, lambda r: r["client_average"]["mean"]),
                     "oracle": _stat(runs, lambda r: r["extra"]["components"]["personal_oracle"]["client_average"]
                                     ["mean"]),
                     "global_only": _stat(runs, lambda r: r["extra"]["components"]["global_only"]["client_average"]
                                          ["mean"]),
                     "selector_accuracy": _stat(runs, lambda r: r["extra"]["selector_accuracy"]["overall"]),
                     "wall_s": _stat(runs, lambda r: r["wall_s"])})
    return rows


def rule_runs(results: Results, task: str, rule: str) -> dict[int, dict[str, Any]]:
    """FedSM's runs with personalization ``rule``: the main FedSM runs for SoftPull, else the rule's jobs."""
    if rule == "softpull":
        return _select(results, task, "main", "fedsm")
    return _select(results, task, "personalization", f"fedsm-{rule}")


def rule_paired_rows(results: Results, task: str, rules: Iterable[str]) -> list[dict[str, Any]]:
    """Per personalization rule (SoftPull first): FedSM's routed test Dice and, seed by seed, its
    difference to FedAvg and to Centralized (client-average mean Dice, each at its best round)."""
    fedavg, central = _select(results, task, "main", "fedavg"), _select(results, task, "main", "centralized")
    rows = []
    for rule in ("softpull", *[r for r in rules if r != "softpull"]):
        runs = rule_runs(results, task, rule)
        mean = {s: r["client_average"]["mean"] for s, r in runs.items()}
        rows.append({
            "rule": rule, "seeds": sorted(runs), "routed": _stat(runs, lambda r: r["client_average"]["mean"]),
            "vs_fedavg": {s: mean[s] - fedavg[s]["client_average"]["mean"] for s in sorted(set(mean) & set(fedavg))},
            "vs_centralized": {s: mean[s] - central[s]["client_average"]["mean"]
                               for s in sorted(set(mean) & set(central))},
            "best_round": {s: r.get("best_round") for s, r in sorted(runs.items())},
            "own_share": _stat(runs, lambda r: float(np.mean([f[site] for site, f in r["extra"]["routing"].items()]))),
        })
    return rows


#: The acceptance of issue 32 for the default rule: FedSM - FedAvg above 0 on every fundus seed and
#: at least this on every prostate seed.
PROSTATE_MARGIN = -0.005


def choose_rule(results: Results, tasks: Iterable[str], rules: Iterable[str]) -> dict[str, Any]:
    """The personalization rule with the best paired result against FedAvg over the tasks.

    Score: the mean over tasks of the rule's mean per-seed FedSM - FedAvg difference (each task
    weighs the same, whatever its seeds). Only rules measured on every task and on every seed
    FedAvg ran are ranked. ``meets`` says whether a rule is above FedAvg on every fundus seed and
    within :data:`PROSTATE_MARGIN` on every prostate seed.
    """
    rules = list(rules)
    by_task = {t: {r["rule"]: r for r in rule_paired_rows(results, t, rules)} for t in tasks}
    ranked: list[dict[str, Any]] = []
    for rule in next(iter(by_task.values()), {}):
        per_task, complete, meets = {}, True, True
        for task, rows in by_task.items():
            diffs = rows[rule]["vs_fedavg"]
            if not diffs or set(diffs) != set(_select(results, task, "main", "fedavg")):
                complete = False
                break
            per_task[task] = float(np.mean(list(diffs.values())))
            if task == "fundus":
                meets = meets and all(d > 0 for d in diffs.values())
            else:
                meets = meets and all(d >= PROSTATE_MARGIN for d in diffs.values())
        if complete:
            ranked.append({"rule": rule, "score": float(np.mean(list(per_task.values()))), "per_task": per_task,
                           "meets": meets})
    ranked.sort(key=lambda r: r["score"], reverse=True)
    return {"ranked": ranked, "best": ranked[0]["rule"] if ranked else None}


def unseen_summary(results: Results, task: str) -> dict[str, Any]:
    """The unseen-site analysis: gamma sweeps on the unseen and participating sites, baselines."""
    fedsm = _select(results, task, "unseen", "fedsm")
    fedavg = _select(results, task, "unseen", "fedavg")
    out: dict[str, Any] = {"seeds": sorted(fedsm), "fedavg_seeds": sorted(fedavg)}
    if fedsm:
        first = next(iter(fedsm.values()))
        out["site"] = first["unseen_site"]
        unseen = [r["unseen"] for r in fedsm.values()]
        out["models"] = first["unseen"]["models"]
        out["unseen_rows"] = gamma_rows(unseen, own=False)
        out["participating_rows"] = gamma_rows([r["participating"] for r in fedsm.values()], own=True)
        site = out["site"]
        out["per_model"] = {m: mean_std([u["per_model"][site][m] for u in unseen])[0] for m in out["models"]}
        out["confidence"] = mean_std([u["confidence"][site]["mean"] for u in unseen])
        out["argmax"] = {m: mean_std([u["argmax"][site][m] for u in unseen])[0] for m in out["models"][1:]}
    out["fedavg"] = _stat(fedavg, lambda r: r["unseen_dice"])
    return out


def curve_series(results: Results, task: str, methods: Iterable[str]) -> dict[str, dict[str, list[float]]]:
    """Per method and series (``global``, ``personal``): mean validation Dice per round over seeds."""
    out: dict[str, dict[str, list[float]]] = {}
    for m in methods:
        runs = _select(results, task, "main", m)
        curves = [r.get("curves") or [] for r in runs.values()]
        curves = [c for c in curves if c]
        if not curves:
            continue
        rounds = min(len(c) for c in curves)
        series: dict[str, list[float]] = {"round": [float(p["round"]) for p in curves[0][:rounds]]}
        for name in ("global", "personal"):
            if all(name in c[0] for c in curves):
                series[name] = [mean_std([c[i][name] for c in curves])[0] for i in range(rounds)]
        out[m] = series
    return out


def loss_series(results: Results, task: str, methods: Iterable[str]) -> dict[str, list[float]]:
    """Per method: mean training loss per round (global model's loss for FedSM), over sites and seeds."""
    out: dict[str, list[float]] = {}
    for m in methods:
        runs = _select(results, task, "main", m)
        per_run = []
        for r in runs.values():
            values = []
            for rnd in r["rounds"]:
                losses = [mt.get("loss", mt.get("loss_global")) for mt in rnd["metrics"].values()]
                losses = [v for v in losses if v is not None]
                if losses:
                    values.append(float(np.mean(losses)))
            per_run.append(values)
        per_run = [v for v in per_run if v]
        if per_run:
            n = min(len(v) for v in per_run)
            out[m] = [float(np.mean([v[i] for v in per_run])) for i in range(n)]
    return out


def plateau(curve: list[dict[str, Any]], series: str, rounds: int, share: float = 0.2,
            tolerance: float = 0.01) -> dict[str, Any]:
    """Plateau criterion on one validation curve: max - min over the last ``share`` of the training rounds.

    Uses the points with ``round > rounds * (1 - share)`` (at least two). ``flat`` is ``None`` when
    the curve has fewer than two points there (not evaluated every round, or too short).
    """
    start = rounds * (1.0 - share)
    values = [float(p[series]) for p in curve
              if p.get("round", 0) > start and series in p and p[series] is not None and math.isfinite(p[series])]
    if len(values) < 2:
        return {"span": float("nan"), "flat": None, "points": len(values)}
    span = max(values) - min(values)
    return {"span": span, "flat": span <= tolerance + 1e-9, "points": len(values), "last": values[-1]}


def curve_key(method: str) -> str:
    """Series the plateau criterion reads: the site models for Local, the global model otherwise."""
    return "personal" if method == "local" else "global"


def plateau_rows(results: Results, task: str, methods: Iterable[str], rounds: int, share: float,
                 tolerance: float) -> list[dict[str, Any]]:
    """Per method and seed: validation span over the last ``share`` of rounds, flat or not, best round."""
    rows = []
    for m in methods:
        runs = _select(results, task, "main", m)
        if not runs:
            continue
        per_seed = {}
        for seed, r in sorted(runs.items()):
            check = plateau(r.get("curves") or [], curve_key(m), rounds, share, tolerance)
            check["best_round"] = r.get("best_round")
            per_seed[seed] = check
        flats = [c["flat"] for c in per_seed.values()]
        verdict = None if any(f is None for f in flats) else all(flats)
        rows.append({"method": m, "per_seed": per_seed, "flat": verdict})
    return rows


def paired_per_seed(results: Results, task: str, a: str, b: str) -> dict[int, dict[str, Any]]:
    """Per seed: ``a - b`` client-average mean test Dice and each method's best round."""
    ra, rb = _select(results, task, "main", a), _select(results, task, "main", b)
    return {s: {"diff": ra[s]["client_average"]["mean"] - rb[s]["client_average"]["mean"],
                "rounds": (ra[s].get("best_round"), rb[s].get("best_round"))} for s in sorted(set(ra) & set(rb))}


def time_rows(results: Results, task: str) -> list[dict[str, Any]]:
    """Where a task's time went: per method and analysis, total job seconds, share and validation share."""
    by: dict[tuple[str, str], dict[str, float]] = {}
    for k, r in results.items():
        if k.task != task:
            continue
        entry = by.setdefault((k.analysis, k.method), {"wall_s": 0.0, "validation_s": 0.0, "jobs": 0})
        entry["wall_s"] += float(r.get("job_wall_s", r.get("wall_s", 0.0)) or 0.0)
        entry["validation_s"] += float(r.get("validation_s", 0.0) or 0.0)
        entry["jobs"] += 1
    total = sum(e["wall_s"] for e in by.values()) or 1.0
    return [{"analysis": a, "method": m, **e, "share": e["wall_s"] / total}
            for (a, m), e in sorted(by.items(), key=lambda kv: -kv[1]["wall_s"])]
