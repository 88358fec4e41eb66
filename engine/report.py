"""Simulation report files: ``report.json`` (schema in docs/report-schema.md) and ``report.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine import catalogue
from engine.bundle.supermodel import single_model_methods
from engine.fl.registry import SPLIT_LEARNING_METHODS
from engine.io.atomic import write_text_atomic
from engine.io.privacy import scrub_absolute_paths
from engine.models.selector import head_parameter_count
from engine.tasks import TaskSpec

#: Titles of the dialogue methods; the weight methods' titles are in :mod:`engine.catalogue`.
DIALOGUE_TITLES = {"blackfed-v1": "BlackFed v1", "blackfed-v2": "BlackFed v2", "split-whitebox": "White-box split",
                   "fediod": "FedIOD"}


def method_title(name: str) -> str:
    """How reports name a method: its catalogue title, a dialogue method's, else the name itself."""
    if name in catalogue.method_names():
        return catalogue.method(name).title
    return DIALOGUE_TITLES.get(name, name)


def traffic_summary(task: TaskSpec, cfg: Any, num_sites: int, results: dict[str, Any]) -> dict[str, Any]:
    """Bytes per site per round for each method, and FedSM with VGG's classic selector head.

    The classic-head figure replaces the selector's head in both directions of FedSM's
    payload, computed from parameter counts (float32), so no 120M-parameter model is built.
    """
    out: dict[str, Any] = {"unit": "bytes, float32 tensors, mean over sites and rounds"}
    for name, r in results.items():
        b = r.bytes_per_round
        if not b:
            continue
        out[name] = {
            "received_per_site_round": sum(v["received_mean"] for v in b.values()) / len(b),
            "sent_per_site_round": sum(v["sent_mean"] for v in b.values()) / len(b),
        }
    if "fedsm" in out:
        # the reference selector ships its Adam moments with it: the head counts three times
        copies = 1 if getattr(cfg, "selector_calibration", "none") == "lda" else 3
        width = getattr(cfg, "selector_width", 64)
        extra = 4 * copies * (head_parameter_count("classic", num_sites, width)
                              - head_parameter_count(cfg.selector_head, num_sites, width))
        if cfg.selector_head == "classic":
            extra = 0
        out["fedsm_classic_selector_head"] = {
            "received_per_site_round": out["fedsm"]["received_per_site_round"] + extra,
            "sent_per_site_round": out["fedsm"]["sent_per_site_round"] + extra,
            "note": "FedSM payload with VGG-11's 25088-4096-4096 head instead of the pooled head "
                    "(with the reference selector, its Adam moments too: x3)",
        }
    return out


def _gamma_choice_line(choice: dict[str, Any]) -> str:
    """``--gamma auto``: the federation's gamma and what it rests on."""
    return (f"Gamma chosen by the federation (`--gamma auto`): {choice['gamma']:.2f}, passed by "
            f"{choice['pass_fraction']:.0%} of the validation images the selector recognised "
            f"({_fmt(choice['accuracy'])} of {int(choice['images'])} validation images).")


def _selector_lines(sel: dict[str, Any]) -> list[str]:
    """The selector and routing-guard analysis (:mod:`engine.selector_report`) as Markdown."""
    unseen = sel.get("unseen_site")
    lines = ["", f"### Selector ({sel.get('calibration', 'none')} calibration)"
             + (f", {unseen} held out as unseen" if unseen else ""), "",
             f"Expected calibration error on participating sites' test images {_fmt(sel['ece']['participating'])} "
             f"(accuracy {_fmt(sel['ece']['accuracy'])}); median confidence seen "
             f"{_fmt(sel['confidence']['seen'].get('quantiles', {}).get('median'))}"
             + (f", unseen {_fmt(sel['confidence']['unseen'].get('quantiles', {}).get('median'))}"
                if "unseen" in sel["confidence"] else "") + ".", "",
             *([_gamma_choice_line(sel["gamma_choice"]), ""] if "gamma_choice" in sel else []),
             *([_routing_choice_line(sel["routing_choice"]), ""] if "routing_choice" in sel else []),
             "| gamma | seen to global | seen to own site | seen to other site | unseen to global |",
             "|---|---|---|---|---|"]
    for row in sel["routing_per_gamma"]:
        seen = row["seen"]
        lines.append(f"| {row['gamma']:.2f} | {seen['global']:.2f} | {seen['own_site']:.2f} | "
                     f"{seen['other_site']:.2f} | {_fmt(row['unseen']['global']) if 'unseen' in row else '-'} |")
    style = sel.get("style_routing")
    if style:
        lines += ["", "Style routing (each image to the style gate's nearest site, global outside the gate): "
                  f"seen to own site {style['seen']['own_site']:.2f}, to global {style['seen']['global']:.2f}"
                  + (f"; unseen to global {style['unseen']['global']:.2f}" if "unseen" in style else "") + "."]
    dice = sel["dice"]
    by = "style routing" if dice.get("routing") == "style" else f"gamma {dice['gamma']:.2f}"
    extra = " | style routing, guard on" if style else ""
    lines += ["", f"| mean Dice, {by} | guard on | guard off | global alone{extra} |",
              "|---|---|---|---|" + ("---|" if style else "")]
    for where in ("participating", "unseen"):
        if dice.get(where):
            d = dice[where]
            lines.append(f"| {where} | {_fmt(d['guard_on'])} | {_fmt(d['guard_off'])} | {_fmt(d['global_only'])} |"
                         + (f" {_fmt(d.get('style'))} |" if style else ""))
    allowed = [s for s, g in sel.get("guard", {}).items() if g["personal_allowed"]]
    lines += ["", "Routing guard: personalized models allowed for "
              + (", ".join(allowed) if allowed else "no site") + "."]
    return lines


def _routing_choice_line(choice: dict[str, float]) -> str:
    """One sentence on the rule ``site_routing: auto`` kept, and why."""
    rule = "style routing" if choice.get("style") else "the selector"
    return (f"Site routing (auto): the federation kept {rule}; on the participating sites' validation images "
            f"the selector sent {_fmt(choice.get('selector_own'))} to their own site's model at the run's gamma, "
            f"style routing {_fmt(choice.get('style_own'))} (before the gate; "
            f"{int(choice.get('images', 0))} images).")


def _fmt(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.4f}"


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def render_markdown(report: dict[str, Any]) -> str:
    """Human-readable report: a Dice table like the paper's Table 3 plus routing and traffic."""
    cfg = report["config"]
    labels = report["task"]["label_names"]
    sites = [s["name"] for s in report["sites"]]
    lines = [
        f"# FedSM simulation: {cfg['task']}, {len(sites)} sites, {cfg['rounds']} rounds",
        "",
        f"Created {report['created']} on {report['machine']['device']} "
        f"({report['machine']['platform']}, torch {report['machine']['torch']}); wall time {report['wall_s']} s.",
        f"Image size {cfg['image_size']} px, selector input {cfg['selector_size']} px, seed {cfg['seed']}, "
        f"lam {cfg['lam']}, gamma {cfg['gamma']}, local epochs {cfg['epochs']}, batch {cfg['batch_size']}"
        + (f"; FedSM personalization {cfg['personalization']}" if cfg.get("personalization") else "") + ".",
        "",
        "## Sites",
        "",
        "| site | train | validation | test |",
        "|---|---|---|---|",
    ]
    for s in report["sites"]:
        lines.append(f"| {s['name']} | {s['train']['cases']} cases / {s['train']['images']} images | "
                     f"{s['validation']['cases']} | {s['test']['cases']} |")
    structures = [*labels, "mean"] if len(labels) > 1 else ["mean"]
    for structure in structures:
        title = "mean over structures" if structure == "mean" and len(labels) > 1 else structure
        lines += ["", f"## Test Dice ({title})", "",
                  "| method | " + " | ".join(sites) + " | client average | global (pooled) |",
                  "|---" * (len(sites) + 3) + "|"]
        for name, r in report["methods"].items():
            cells = [_fmt(r["dice"][s][structure]) for s in sites]
            lines.append(f"| {method_title(name)} | " + " | ".join(cells)
                         + f" | {_fmt(r['client_average'][structure])} | {_fmt(r['pooled'][structure])} |")
    for name in ("fedsm", "fedsm-extra"):
        r = report["methods"].get(name)
        if not r:
            continue
        extra = r["extra"]
        lines += ["", f"## {method_title(name)}: selector and routing", "",
                  f"Selector accuracy on held-out images of participating sites: "
                  f"{extra['selector_accuracy']['overall']:.4f} "
                  + "(" + ", ".join(f"{s} {extra['selector_accuracy'].get(s, float('nan')):.3f}" for s in sites) + ")",
                  "",
                  "Routing frequency on each site's test images (rows: where the image came from):", "",
                  "| test site | global | " + " | ".join(sites) + " |",
                  "|---" * (len(sites) + 2) + "|"]
        for s in sites:
            freq = extra["routing"][s]
            lines.append(f"| {s} | {freq['global']:.2f} | " + " | ".join(f"{freq[t]:.2f}" for t in sites) + " |")
        comp = extra["components"]
        lines += ["", f"Components (client average, mean Dice): global model alone "
                      f"{_fmt(comp['global_only']['client_average']['mean'])}, each site's personalized model on "
                      f"its own site {_fmt(comp['personal_oracle']['client_average']['mean'])}."]
        if "selector" in extra:
            lines += _selector_lines(extra["selector"])
        lines += per_site_evidence_lines(report, name, sites)
    lines += _local_ood_lines(report, sites)
    if report["methods"].get("fediod"):
        lines += fediod_section(report["methods"]["fediod"], sites, structures)
    lines += ["", "## Traffic per site per round", "", "| method | received | sent |", "|---|---|---|"]
    for name, t in report["traffic"].items():
        if isinstance(t, dict) and "received_per_site_round" in t:
            title = ("FedSM with VGG-11's classic selector head (computed, not run)"
                     if name == "fedsm_classic_selector_head" else method_title(name))
            lines.append(f"| {title} | {_mib(t['received_per_site_round'])} | "
                         f"{_mib(t['sent_per_site_round'])} |")
    keep = cfg.get("keep_best", False)
    lines += ["", "## Wall time and evaluated round", "",
              "| method | seconds | evaluated round" + (" (best by validation Dice)" if keep else "") + " |",
              "|---|---|---|"]
    for name, r in report["methods"].items():
        best = r.get("best_round")
        lines.append(f"| {method_title(name)} | {r['wall_s']:.1f} | {best if best is not None else '—'} |")
    if report.get("supermodel"):
        lines += ["", "## Super model", ""]
        for name, s in report["supermodel"].items():
            title = method_title(name)
            if s.get("error"):
                lines.append(f"- {title}: not written ({s['error']})")
                continue
            lines.append(f"- {title}: `{s['path']}` ({_mib(s['bytes'])}, sha256 `{s['sha256']}`)")
    return "\n".join(lines) + "\n"


def per_site_evidence_lines(report: dict[str, Any], method: str, sites: list[str]) -> list[str]:
    """Does the super model help *this* site? Per site: routed, global-alone, own personalized and
    (when the run trained it) Local test Dice, and where the site's test images were routed.

    Empty for reports written before the per-site components were recorded.
    """
    r = report["methods"][method]
    comp = r["extra"].get("components", {})
    glob, own = comp.get("global_only", {}).get("per_site"), comp.get("personal_oracle", {}).get("per_site")
    if not glob or not own:
        return []
    local = report["methods"].get("local")
    routing = r["extra"].get("routing", {})
    rule = r["extra"].get("personalization", "softpull")
    lines = ["", f"### {method_title(method)} per site: does the super model help each site?", "",
             f"Mean test Dice at each site (personalized models trained with {rule}): the routed super model, the "
             "global model alone, the site's own personalized model, and the site's Local model where the run "
             "trained one; then the share of the site's test images routed to the global model, to the site's own "
             "personalized model and to another site's. Routed minus global is what the super model adds here.", "",
             "| site | routed | global alone | own personalized | Local | routed − global | to global | to own "
             "model | to another site |", "|---" * 9 + "|"]
    for s in sites:
        routed = r["dice"][s]["mean"]
        freq = routing.get(s, {})
        to_own = freq.get(s, float("nan"))
        to_global = freq.get("global", float("nan"))
        to_other = sum(v for k, v in freq.items() if k not in ("global", s)) if freq else float("nan")
        local_cell = _fmt(local["dice"][s]["mean"]) if local else "—"
        lines.append(f"| {s} | {_fmt(routed)} | {_fmt(glob[s]['mean'])} | {_fmt(own[s]['mean'])} | {local_cell} | "
                     f"{routed - glob[s]['mean']:+.4f} | {to_global:.2f} | {to_own:.2f} | {to_other:.2f} |")
    return lines


#: What "each site's model" is in the local/OOD table, per method family.
_LOCAL_OOD_MODELS = {
    "split": "each site's client net with the server net it segments with",
    "personalized": "each site's personalized model",
    "global": "the one global model, the same at every site (so a site's OOD is the mean of the other sites' "
              "local values)",
    "local": "each site's own model, trained on its data alone",
    "other": "the model each site segments with",
}


def _local_ood_family(name: str) -> str:
    """The local/OOD table's method family of ``name`` (a key of :data:`_LOCAL_OOD_MODELS`)."""
    if name in SPLIT_LEARNING_METHODS:
        return "split"
    if name == "local":
        return "local"
    if name in single_model_methods():
        return "global"
    if name.startswith("fedsm"):
        return "personalized"
    return "other"


def local_ood_caption(methods: list[str]) -> str:
    """The local/OOD table's caption: which model a site's row scores, said for each method family present.

    Split networks (BlackFed) score each site's client net with its server net; FedSM each
    site's personalized model; FedAvg, FedProx, Scaffold, Centralized and FedIOD the one global
    model (the same at every site, so a site's OOD is the mean of the other sites' local values);
    Local each site's own model.
    """
    families: dict[str, list[str]] = {}
    for name in methods:
        families.setdefault(_local_ood_family(name), []).append(method_title(name))
    clauses = [f"{', '.join(titles)}: {_LOCAL_OOD_MODELS[family]}" for family, titles in families.items()]
    return ("Dice of the model each site segments with, on its own test set (local) and on the other sites' test "
            "sets (OOD, mean). " + "; ".join(clauses) + ".")


def _local_ood_lines(report: dict[str, Any], sites: list[str]) -> list[str]:
    """Per-site local / OOD Dice of the methods that report it (dialogue methods such as BlackFed)."""
    rows = {n: r["extra"]["local_ood"] for n, r in report["methods"].items() if r.get("extra", {}).get("local_ood")}
    if not rows:
        return []
    lines = ["", "## Local and out-of-distribution Dice", "", local_ood_caption(list(rows)), "",
             "| method | " + " | ".join(f"{s} local | {s} OOD" for s in sites) + " |",
             "|---" * (2 * len(sites) + 1) + "|"]
    for name, per_site in rows.items():
        cells = [f"{_fmt(per_site[s]['local'])} | {_fmt(per_site[s]['ood'])}" for s in sites]
        lines.append(f"| {method_title(name)} | " + " | ".join(cells) + " |")
    return lines


def fediod_section(result: dict[str, Any], sites: list[str], structures: list[str]) -> list[str]:
    """FedIOD's part of ``report.md``: the student beside each site's teacher (Standalone), and epsilon per site."""
    extra = result.get("extra", {})
    lines = ["", "## FedIOD: distilled student, teachers (Standalone) and privacy", "",
             "Client-average test Dice; each teacher is evaluated on every site's test split.", "",
             "| model | " + " | ".join(structures) + " |", "|---" * (len(structures) + 1) + "|",
             "| FedIOD student | " + " | ".join(_fmt(result["client_average"][k]) for k in structures) + " |"]
    standalone = extra.get("standalone") or {}
    for site, r in standalone.get("models", {}).items():
        lines.append(f"| teacher of {site} | " + " | ".join(_fmt(r["client_average"][k]) for k in structures) + " |")
    if standalone.get("mean"):
        lines.append("| Standalone (mean ± std) | " + " | ".join(
            f"{_fmt(standalone['mean'][k])} ± {_fmt(standalone['std'][k])}" for k in structures) + " |")
    eps = extra.get("epsilon", {})
    lines += ["", "| site | teacher validation Dice | noise multiplier | releases | epsilon (delta) |",
              "|---|---|---|---|---|"]
    for s in sites:
        e = eps.get(s)
        lines.append(f"| {s} | {_fmt(extra.get('teacher_val_dice', {}).get(s))} | "
                     f"{extra.get('noise_multiplier', {}).get(s, 0.0):.3g} | {extra.get('releases', {}).get(s, 0)} | "
                     + ("no DP (infinite)" if e is None else f"{e:.3g} ({extra.get('delta', {}).get(s, 0):.0e})")
                     + " |")
    lines += ["", "Epsilon covers only the released input gradients; teacher logits and discriminator "
                  "scores are sent without noise (see docs/architecture.md, FedIOD)."]
    return lines


def write_reports(out_dir: Path, report: dict[str, Any]) -> None:
    """Write ``report.json`` and ``report.md`` atomically."""
    # Folder names can name patients or sites: the report keeps no absolute path.
    report = scrub_absolute_paths(report, out_dir)
    write_text_atomic(Path(out_dir) / "report.json", report_json(report) + "\n")
    write_text_atomic(Path(out_dir) / "report.md", render_markdown(report))


def report_json(report: dict[str, Any]) -> str:
    """The report as pretty JSON (NaN written as null)."""
    return json.dumps(_nan_to_none(report), indent=2, sort_keys=False)


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_nan_to_none(v) for v in obj]
    return obj
