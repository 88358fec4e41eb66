"""``results.md`` and its plots, regenerated from the cached benchmark results.

The markdown states the command, machine, preset and seeds beside the tables, lists what did
not complete, and derives its comparisons ("FedSM vs FedAvg: +0.012") from the numbers. A
hand-written reading between ``<!-- reading:start -->`` and ``<!-- reading:end -->`` in an
existing file is kept when the file is regenerated (``preserve_reading``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.bench import plots, tables
from engine.bench.cache import JobKey, ResultCache
from engine.bench.presets import BenchPreset
from engine.bench.runner import ALL_TASKS, plan_jobs
from engine.io.atomic import write_text_atomic
from engine.tasks import get_task

READING_START, READING_END = "<!-- reading:start -->", "<!-- reading:end -->"
DEFAULT_READING = "_No reading written yet: add one between the reading markers; regeneration keeps it._"
T = tables.METHOD_TITLES


def collect(cache: ResultCache, preset: BenchPreset,
            settings_for: Callable[[JobKey], dict[str, Any]]) -> dict[JobKey, dict[str, Any]]:
    """Results of the preset's planned jobs (and main FedSM runs) whose settings match."""
    keys = plan_jobs(preset)
    out: dict[JobKey, dict[str, Any]] = {}
    for key in keys:
        doc = cache.load(key, settings_for(key))
        if doc is not None:
            out[key] = doc["result"]
    return out


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
                  img: Callable[[str], tuple[Path, str]]) -> list[str]:
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
    by = {r["method"]: r for r in rows}
    lines += ["", "Paired differences in client-average mean Dice (same data and seed; mean ± std over seeds):", ""]
    for a, b in (("fedsm", "fedavg"), ("fedsm", "centralized"), ("fedsm", "local"), ("fedsm-extra", "fedsm"),
                 ("fedsm-extra", "fedavg"), ("fedavg", "centralized"), ("fedprox", "fedavg"),
                 ("scaffold", "fedavg")):
        if a in by and b in by:
            lines.append(f"- {T[a]} − {T[b]}: {_diff(tables.paired_difference(results, task_name, a, b))}")
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
                      "own site (oracle routing).", ""]
        lines += _table(["method", "selector acc.", "routed to own", "routed to global", "routed Dice",
                         "global alone", "personalized (oracle)"],
                        [[T[r["method"]], _ms(r["selector_accuracy"], 3), _ms(r["own_share"], 2),
                          _ms(r["global_share"], 2), _ms(r["routed"]), _ms(r["global_only"]), _ms(r["oracle"])]
                         for r in detail])
    traffic = [r for r in rows if r["received"][2]]
    if traffic:
        lines += ["", f"Traffic per site per round ({task_name}, mean over rounds incl. calibration/selector "
                      "rounds):", ""]
        lines += _table(["method", "received", "sent"],
                        [[T.get(r["method"], r["method"]), _mib(r["received"][0]), _mib(r["sent"][0])]
                         for r in traffic])
    path, rel = img(f"main-{task_name}.png")
    if plots.plot_bars(rows, "mean", T, f"{task_name} ({tp.sites} sites, {tp.image_size} px, {tp.rounds} rounds)",
                       "client-average test Dice", path, tables.PAPER_CLIENT_AVERAGE.get(task_name)):
        lines += ["", f"![{task_name} main comparison]({rel})"]
    curves = tables.curve_series(results, task_name, preset.methods)
    losses = tables.loss_series(results, task_name, preset.methods)
    path, rel = img(f"curves-{task_name}.png")
    if plots.plot_curves(curves, losses, T, task_name, path):
        lines += ["", "Training curves (the paper's Figure 2 analogue; mean over seeds):", "",
                  f"![{task_name} training curves]({rel})"]
    return lines


def _analysis_sections(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, task_name: str,
                       img: Callable[[str], tuple[Path, str]]) -> list[str]:
    tp = preset.task(task_name)
    lines: list[str] = []
    # lam sweep
    lam = tables.lam_rows(results, task_name, tp.lam, tp.sites, preset.lam_values, preset.analysis_seeds)
    lines += ["", f"### {task_name}: SoftPull lam sweep (the paper's Table 7)", "",
              f"FedSM trained with each lam (values below 1/K = {1 / tp.sites:.3f} are raised to 1/K, the engine's "
              f"lower bound); seeds {', '.join(map(str, preset.analysis_seeds))}.", ""]
    lines += _table(["lam", "lam used", "routed Dice", "personalized (oracle)", "global alone", "seeds"],
                    [[f"{r['lam']:.2f}", f"{r['lam_used']:.3f}", _ms(r["routed"]), _ms(r["oracle"]),
                      _ms(r["global_only"]), ", ".join(map(str, r["seeds"])) or "not run"] for r in lam])
    path, rel = img(f"lam-{task_name}.png")
    if plots.plot_lam(lam, task_name, path):
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
    path, rel = img(f"gamma-{task_name}.png")
    if plots.plot_gamma(part, unseen.get("unseen_rows", []), unseen.get("site"), task_name, path):
        lines += ["", f"![{task_name} gamma]({rel})"]
    # personalization alternatives
    pers = tables.personalization_rows(results, task_name, preset.personalizations, preset.analysis_seeds)
    lines += ["", f"### {task_name}: personalization inside FedSM (the paper's Table 6)", "",
              "Global model (FedAvg) and selector trained as in FedSM; only the personalized models differ. "
              "Hyper-parameters: `engine/fl/personalization.py` (`PersonalizationConfig` defaults).", ""]
    lines += _table(["personalization", "routed Dice", "personalized (oracle)", "global alone", "selector acc.",
                     "wall s", "seeds"],
                    [[T.get(r["method"], r["method"]), _ms(r["routed"]), _ms(r["oracle"]), _ms(r["global_only"]),
                      _ms(r["selector_accuracy"], 3), tables.fmt(r["wall_s"][0], digits=0),
                      ", ".join(map(str, r["seeds"])) or "not run"] for r in pers])
    path, rel = img(f"personalization-{task_name}.png")
    if plots.plot_bars(pers, "routed", T, f"{task_name}: personalization inside FedSM", "routed Dice", path):
        lines += ["", f"![{task_name} personalization]({rel})"]
    return lines


def _perf_section(results: dict[JobKey, dict[str, Any]]) -> list[str]:
    perf = next((r for k, r in results.items() if k.analysis == "perf"), None)
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
        [f"routed inference vs selector + all {inf.get('models')} U-Nets ({inf.get('image_size')} px)",
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
    return lines


def _num(d: dict[str, Any], kind: str, key: str, digits: int) -> str:
    value = d.get(kind, {}).get(key)
    return "—" if value is None else f"{value:.{digits}f}"


def _site_size_lines(preset: BenchPreset) -> list[str]:
    """Cases per synthetic site and split (unequal like the paper's Table 1)."""
    from engine.data.synth import site_profiles, split_counts

    lines = ["Synthetic sites (cases per site; training / validation / test cases; prostate cases are volumes "
             "whose slices are the samples):", ""]
    for tp in preset.tasks:
        parts = []
        for k, profile in enumerate(site_profiles(tp.task, tp.sites)):
            tr, va, te = split_counts(profile.cases)
            parts.append(f"site{k + 1} {profile.cases} ({tr}/{va}/{te})")
        lines.append(f"- {tp.task}: " + ", ".join(parts))
    return lines


def _read_reading(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return DEFAULT_READING
    m = re.search(re.escape(READING_START) + r"\n?(.*?)\n?" + re.escape(READING_END), text, re.S)
    return m.group(1).strip() if m and m.group(1).strip() else DEFAULT_READING


def render(results: dict[JobKey, dict[str, Any]], preset: BenchPreset, meta: dict[str, Any],
           img: Callable[[str], tuple[Path, str]], reading: str = DEFAULT_READING) -> str:
    """The whole markdown document."""
    machine, run = meta["machine"], meta["run"]
    planned = meta["planned"]
    done = {k.label for k in results}
    missing = [label for label in planned if label not in done]
    lines = [
        f"# Benchmark results: preset `{preset.name}`", "",
        "Generated by `fedsm bench` from the cached job results; do not edit by hand except between the "
        "reading markers.", "",
        "## How these numbers were made", "",
        f"- Command: `{meta.get('command') or 'fedsm bench --preset ' + preset.name}`",
        f"- Finished: {meta['finished']}; this invocation ran {len(run['ran'])} job(s), reused "
        f"{len(run['cached'])} cached, {len(run['failed'])} failed, in {run.get('wall_s', 0):.0f} s.",
        f"- Machine: {machine['platform']}, {machine['processor']}, {machine['cpu_count']} CPU cores visible, "
        f"torch {machine['torch']} with {machine['torch_threads']} thread(s), device {machine['device']}"
        + (f" ({machine['gpu']})" if machine.get("gpu") else "")
        + f"; load average at start {machine.get('load_average_at_start')}.",
        f"- Preset: {preset.description}.",
        f"- Seeds: main comparison {', '.join(map(str, preset.seeds))}; analyses "
        f"{', '.join(map(str, preset.analysis_seeds))}; data seed {preset.data_seed} (the same synthetic data for "
        "every training seed; the seed changes initialisation and batch order).",
        f"- Training: {preset.epochs} local epoch(s) per round, batch {preset.batch_size}, Adam lr {preset.lr}, "
        f"selector lr {preset.selector_lr} on {preset.selector_size} px inputs, gamma {preset.gamma}, FedProx mu "
        f"{preset.prox_mu}.",
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
    lines += ["", "## Reading", "", READING_START, reading, READING_END, "", "## Main comparison (the paper's Table 3)",
              "", "Paper (client average, 6 real sites, 256 px, 150 rounds): retinal — Centralized 0.8898, FedAvg "
              "0.8710, FedProx 0.8434, Scaffold 0.8141, FedSM 0.8914, FedSM-extra 0.8905; prostate — Centralized "
              "0.8737, FedAvg 0.8684, FedSM 0.8763.", ""]
    for tp in preset.tasks:
        lines += _main_section(results, preset, tp.task, img)
        lines.append("")
    lines += ["## Analyses"]
    for tp in preset.tasks:
        lines += _analysis_sections(results, preset, tp.task, img)
    lines += _perf_section(results)
    lines += ["", "## Configuration", "", "```json", json.dumps(preset.to_json(), indent=1), "```", ""]
    return "\n".join(lines)


def write_report(cache: ResultCache, preset: BenchPreset, meta: dict[str, Any], out_dir: Path, *,
                 img_prefix: str = "img", img_dir: Path | None = None,
                 settings_for: Callable[[JobKey], dict[str, Any]], preserve_reading: bool = False) -> Path:
    """Write ``out_dir/results.md`` and its PNG plots; return the markdown path."""
    out_dir = Path(out_dir)
    img_dir = Path(img_dir) if img_dir is not None else out_dir / img_prefix
    img_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "results.md"
    results = collect(cache, preset, settings_for)

    def img(name: str) -> tuple[Path, str]:
        return img_dir / name, f"{img_prefix}/{name}"

    reading = _read_reading(target) if preserve_reading else DEFAULT_READING
    write_text_atomic(target, render(results, preset, meta, img, reading))
    return target


__all__ = ["ALL_TASKS", "collect", "render", "write_report"]
