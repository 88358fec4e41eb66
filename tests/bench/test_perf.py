"""Performance figures: traffic from the real payloads, and one in-process memory measurement."""

from __future__ import annotations

import pytest

from engine.bench.perf import _memory_child, measure_traffic


def test_traffic_counts_the_three_networks():
    from engine.fl.weights import model_weights, payload_bytes
    from engine.fl.wire_precision import encode_down
    from engine.models import build_segmentation_net, build_selector
    from engine.models.selector import head_parameter_count

    def on_wire(model):  # float32 tensors travel in 16 bits, integer buffers as they are
        return payload_bytes(encode_down({"p": model_weights(model)}, {"p"})["p"])

    t = measure_traffic(sites=6)
    assert t["wire_precision"] == "bfloat16"
    unet = on_wire(build_segmentation_net(3, 2))
    assert unet < 0.51 * payload_bytes(model_weights(build_segmentation_net(3, 2)))
    selector = on_wire(build_selector(3, 6, width=t["selector_width"]))
    assert t["fedavg_bytes_each_way"] == unet
    # the reference-trained selector travels with its Adam moments (two per parameter)
    moments = t["selector_optimizer_bytes"]
    assert moments > 0
    assert t["fedsm_bytes_each_way"] == t["fedsm_bytes_up"] == 2 * unet + selector + moments
    assert t["fedsm_classic_head_bytes_each_way"] - t["fedsm_bytes_each_way"] == 3 * 2 * (
        head_parameter_count("classic", 6) - head_parameter_count("gap", 6))
    assert t["fedsm_extra_selector_round_bytes_down"] == 7 * unet + on_wire(
        build_selector(3, 7, width=t["selector_width"]))
    assert 0 < t["gap_over_classic"] < 0.2


def test_memory_child_reports_round_peak():
    import tracemalloc

    out = _memory_child("fedavg", size=32, batch_size=4, selector_size=32, images=4)
    assert not tracemalloc.is_tracing()  # left on, it would slow the rest of the process
    assert out["kind"] == "fedavg"
    assert out["process_peak_rss_mib"] > 0
    if out["round_peak_rss_mib"] is not None:  # Linux: the high-water mark was reset before the round
        assert out["round_peak_rss_mib"] >= out["rss_before_round_mib"] - 1
        assert out["round_rss_increase_mib"] == pytest.approx(out["round_peak_rss_mib"] - out["rss_before_round_mib"])


def test_routed_inference_records_the_resolved_device_not_auto():
    import torch

    from engine.bench.perf import measure_routed_inference

    out = measure_routed_inference(32, 32, "auto", images=2, repeats=1)
    assert out["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert out["mixed_precision"] is torch.cuda.is_available()
    assert out["routed_s_per_image"] > 0 and out["all_models_s_per_image"] > 0
    assert out["ratio"] == pytest.approx(out["routed_s_per_image"] / out["all_models_s_per_image"])


def test_throughput_times_every_path_and_reports_both_ratios():
    from engine.bench.perf import measure_throughput

    out = measure_throughput(32, 2, 32, "cpu", batches=1, repeats=2)
    for name in ("engine_s", "hand_s", "hand_fused_s"):
        assert len(out[name]) == 2 and all(t > 0 for t in out[name])
    assert out["ratio"] == pytest.approx(out["engine_images_per_s"] / out["hand_images_per_s"])
    assert out["ratio_vs_fused_hand"] == pytest.approx(out["engine_images_per_s"] / out["hand_fused_images_per_s"])



def test_engine_adam_runs_its_fused_kernel_on_cpu():
    """The hand-written loop's fused variant is only a fair comparison if the engine is fused too."""
    import torch

    from engine.fl.local_training import Device, _Learner

    learner = _Learner(torch.nn.Linear(3, 2), 1e-3, Device.resolve("cpu"))
    assert learner.opt.defaults["fused"] is True
