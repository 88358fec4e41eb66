"""report.md's "Local and out-of-distribution Dice" table says which model each method's rows score."""

from __future__ import annotations

from engine.report import _local_ood_lines, local_ood_caption

SITES = ["site1", "site2"]


def _report(*methods: str) -> dict:
    scores = {s: {"local": 0.8, "ood": 0.6} for s in SITES}
    return {"methods": {m: {"extra": {"local_ood": scores}} for m in methods}}


def _caption(*methods: str) -> str:
    lines = _local_ood_lines(_report(*methods), SITES)
    assert lines[1] == "## Local and out-of-distribution Dice"
    return lines[3]


def test_single_model_methods_are_scored_as_one_global_model():
    for method, title in (("fedavg", "FedAvg"), ("fedprox", "FedProx"), ("scaffold", "Scaffold"),
                          ("centralized", "Centralized")):
        caption = _caption(method)
        assert f"{title}: the one global model, the same at every site" in caption
        assert "client net" not in caption and "server net" not in caption and "personalized" not in caption


def test_local_is_each_sites_own_model_and_split_nets_keep_their_words():
    caption = _caption("local")
    assert "Local: each site's own model, trained on its data alone" in caption and "client net" not in caption
    caption = _caption("blackfed-v2")
    assert "BlackFed v2: each site's client net with the server net it segments with" in caption
    assert "global model" not in caption


def test_a_mixed_table_names_every_family_once_with_its_methods():
    caption = _caption("blackfed-v1", "fedavg", "local", "centralized", "fediod")
    assert "BlackFed v1: each site's client net" in caption
    assert "FedAvg, Centralized, FedIOD: the one global model" in caption
    assert "Local: each site's own model" in caption
    assert caption.count("the one global model") == 1
    assert local_ood_caption(["fedsm"]).endswith("FedSM: each site's personalized model.")
