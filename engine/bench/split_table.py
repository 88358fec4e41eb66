"""The BlackFed comparison of ``fedsm bench`` in the style of its paper's Tables 2-3, and the compute table.

For each site: Dice on its own test set ("local") and mean Dice on the other sites' test sets
("OOD"), for Individual (local) training, BlackFed v1 and v2, white-box split training, FedAvg
and Combined (centralized) training; each site's model is what that site would use (its own
model, or its client net with its server net; FedAvg's and Combined's one global model). Client
compute per image is counted with torch's FLOP counter against a full U-Net.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.bench.cache import JobKey
from engine.fl.blackfed_nets import DEFAULT_SPLIT_CHANNELS, build_client_net, build_server_net
from engine.models import build_segmentation_net

TITLES = {"local": "Individual", "blackfed-v1": "BlackFed v1", "blackfed-v2": "BlackFed v2",
          "split-whitebox": "White-box split", "fedavg": "FedAvg", "centralized": "Combined"}


def split_compute(task: Any, image_size: int, channels: int | None = None) -> dict[str, float]:
    """FLOPs per image of the client net, the server net and the full U-Net at ``image_size``."""
    c = channels or DEFAULT_SPLIT_CHANNELS

    def flops(net: torch.nn.Module, in_channels: int) -> float:
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            net.eval()(torch.zeros(1, in_channels, image_size, image_size))
        return float(counter.get_total_flops())

    return {"client": flops(build_client_net(task.in_channels, c), task.in_channels),
            "server": flops(build_server_net(c, task.out_channels), c),
            "unet": flops(build_segmentation_net(task.in_channels, task.out_channels), task.in_channels),
            "image_size": float(image_size), "channels": float(c)}


def split_rows(results: Mapping[JobKey, dict[str, Any]], task: str,
               methods: tuple[str, ...]) -> tuple[list[str], list[dict[str, Any]]]:
    """Sites and one row per method: mean over seeds of local and OOD Dice per site, and their means."""
    rows: list[dict[str, Any]] = []
    sites: list[str] = []
    for method in methods:
        runs = [r for k, r in results.items() if k.task == task and k.analysis == "blackfed" and k.method == method]
        runs = [r for r in runs if r.get("extra", {}).get("local_ood")]
        if not runs:
            rows.append({"method": method, "seeds": 0})
            continue
        per_site = runs[0]["extra"]["local_ood"]
        sites = sites or list(per_site)
        row: dict[str, Any] = {"method": method, "seeds": len(runs)}
        for site in sites:
            for kind in ("local", "ood"):
                row[f"{site}/{kind}"] = float(np.mean([r["extra"]["local_ood"][site][kind] for r in runs]))
        for kind in ("local", "ood"):
            row[f"mean/{kind}"] = float(np.mean([row[f"{s}/{kind}"] for s in sites]))
        rows.append(row)
    return sites, rows


def split_section(results: Mapping[JobKey, dict[str, Any]], preset: Any, task: str) -> list[str]:
    """Markdown of the BlackFed comparison for ``task`` (empty when the preset has none)."""
    if not preset.split_seeds or task not in preset.split_tasks:
        return []
    sites, rows = split_rows(results, task, tuple(preset.split_methods))
    tp = preset.task(task)
    lines = ["", f"### BlackFed comparison, {task} (its paper's Tables 2-3 style)", "",
             f"Seeds {', '.join(map(str, preset.split_seeds))}; {tp.sites} sites, {tp.image_size} px, {tp.rounds} "
             "rounds; every method evaluated at its last round. Local = the site's model on its own test set, "
             "OOD = the same model on the other sites' test sets (mean). BlackFed, white-box split: "
             "client net of the site + server net (v2: the site's own table entry).", ""]
    if not sites:
        return [*lines, "_No BlackFed jobs completed yet._"]
    header = ["method", *[f"{s} {k}" for s in sites for k in ("local", "OOD")], "mean local", "mean OOD"]
    lines += ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for row in rows:
        if not row["seeds"]:
            dashes = " | ".join("—" for _ in header[1:])
            lines.append(f"| {TITLES.get(row['method'], row['method'])} | {dashes} |")
            continue
        cells = [f"{row[f'{s}/{k}']:.4f}" for s in sites for k in ("local", "ood")]
        cells += [f"**{row['mean/local']:.4f}**", f"**{row['mean/ood']:.4f}**"]
        lines.append(f"| {TITLES.get(row['method'], row['method'])} | " + " | ".join(cells) + " |")
    compute = next((r["compute"] for k, r in results.items() if k.task == task and k.analysis == "blackfed"
                    and "compute" in r), None)
    if compute:
        lines += ["", f"Compute per {int(compute['image_size'])} px image (torch FLOP counter, one forward pass): "
                      f"client net {compute['client'] / 1e6:.1f} MFLOPs, server net {compute['server'] / 1e6:.1f} "
                      f"MFLOPs, full U-Net {compute['unet'] / 1e6:.1f} MFLOPs: the site computes "
                      f"{100 * compute['client'] / compute['unet']:.1f}% of a full U-Net per forward pass "
                      "(BlackFed's client step costs 2P forward passes and no backward pass)."]
    return lines
