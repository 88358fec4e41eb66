"""Benchmark plots as PNG files (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.io.atomic import atomic_path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Figures:
    """Where a report's plots are written and how its markdown links them.

    :meth:`place` draws a plot once. A second report of the same results (``fedsm bench --docs``
    writes the docs copy beside the run's own report) passes the first's ``Figures`` as
    ``drawn_by`` and gets its files copied instead of drawn again (matplotlib's PNG rendering is
    most of a report's time); a plot the first report had nothing for is left out of both.
    """

    def __init__(self, folder: Path, link_prefix: str, drawn_by: Figures | None = None) -> None:
        self.folder = Path(folder)
        self.link_prefix = link_prefix
        self.drawn_by = drawn_by
        #: File names placed so far (the plots that had something to show).
        self.placed: set[str] = set()

    def place(self, name: str, draw: Callable[[Path], Path | None]) -> str | None:
        """The markdown link of plot ``name``, drawn by ``draw(path)`` (``None``: nothing to plot)."""
        path = self.folder / name
        if self.drawn_by is not None:
            if name not in self.drawn_by.placed:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                shutil.copyfile(self.drawn_by.folder / name, tmp)
        elif draw(path) is None:
            return None
        self.placed.add(name)
        return f"{self.link_prefix}/{name}"


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _finite(values: list[float]) -> bool:
    return any(v is not None and math.isfinite(v) for v in values)


def plot_curves(curves: dict[str, dict[str, list[float]]], losses: dict[str, list[float]], titles: dict[str, str],
                task: str, path: Path) -> Path | None:
    """Validation Dice per round (global solid, personalized dashed) and training loss per round."""
    if not curves and not losses:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (method, series) in enumerate(curves.items()):
        colour = f"C{i}"
        if "global" in series and _finite(series["global"]):
            ax1.plot(series["round"], series["global"], "-o", color=colour, ms=3,
                     label=f"{titles.get(method, method)} (global)")
        if "personal" in series and _finite(series["personal"]):
            label = "own model" if method == "local" else "personalized, own site"
            ax1.plot(series["round"], series["personal"], "--s", color=colour, ms=3,
                     label=f"{titles.get(method, method)} ({label})")
    ax1.set_xlabel("round")
    ax1.set_ylabel("validation Dice (client average)")
    ax1.set_title(f"{task}: validation Dice per round")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    order = list(curves)
    for i, (method, values) in enumerate(losses.items()):
        colour = f"C{order.index(method) if method in order else i}"
        ax2.plot(range(1, len(values) + 1), values, "-o", color=colour, ms=3, label=titles.get(method, method))
    ax2.set_xlabel("round")
    ax2.set_ylabel("training Dice loss (mean over sites)")
    ax2.set_title(f"{task}: training loss per round")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    return _save(fig, path)


def plot_bars(rows: list[dict[str, Any]], key: str, titles: dict[str, str], task: str, ylabel: str,
              path: Path, paper: dict[str, float] | None = None) -> Path | None:
    """Bar chart of ``row[key] = (mean, std, n)`` per method, with the paper's values as markers."""
    rows = [r for r in rows if r[key][2] > 0]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar(xs, [r[key][0] for r in rows], yerr=[r[key][1] for r in rows], capsize=4, color="C0", alpha=0.8,
           label="this benchmark (mean ± std over seeds)")
    if paper:
        px = [i for i, r in enumerate(rows) if r["method"] in paper]
        if px:
            ax.plot(px, [paper[rows[i]["method"]] for i in px], "r_", ms=24, mew=2, label="paper")
    ax.set_xticks(list(xs), [titles.get(r["method"], r["method"]) for r in rows], rotation=25, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(task)
    ax.set_ylim(0, 1)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_gamma(participating: list[dict[str, Any]], unseen: list[dict[str, Any]], unseen_site: str | None,
               task: str, path: Path) -> Path | None:
    """Routed Dice and share routed to the global model against gamma."""
    if not participating and not unseen:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, label, style in ((participating, "participating sites", "-o"),
                               (unseen, f"unseen site ({unseen_site})", "--s")):
        if not rows:
            continue
        g = [r["gamma"] for r in rows]
        ax1.plot(g, [r["dice"][0] for r in rows], style, ms=3, label=label)
        ax2.plot(g, [r["global_share"][0] for r in rows], style, ms=3, label=label)
    ax1.set_xlabel("gamma")
    ax1.set_ylabel("routed Dice (client average)")
    ax1.set_title(f"{task}: Dice against gamma")
    ax2.set_xlabel("gamma")
    ax2.set_ylabel("share of images routed to the global model")
    ax2.set_title(f"{task}: routing against gamma")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_lam(rows: list[dict[str, Any]], task: str, path: Path) -> Path | None:
    """Routed, personalized (own site) and global-only Dice against SoftPull's lam."""
    rows = [r for r in rows if r["routed"][2] > 0]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    lam = [float(sum(r["lam_used"]) / len(r["lam_used"])) for r in rows]  # the lam SoftPull used
    for key, label, style in (("routed", "FedSM routed", "-o"), ("oracle", "personalized, own site", "--s"),
                              ("global_only", "global model alone", ":^")):
        ax.errorbar(lam, [r[key][0] for r in rows], yerr=[r[key][1] for r in rows], fmt=style, ms=4, capsize=3,
                    label=label)
    if "one_over_k" in rows[0]:
        ax.axvline(rows[0]["one_over_k"], color="grey", ls=":", lw=1, label="1/K (plain averaging)")
    ax.set_xlabel("SoftPull lam")
    ax.set_ylabel("Dice (client average)")
    ax.set_title(f"{task}: lam sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
