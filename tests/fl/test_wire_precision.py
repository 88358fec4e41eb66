"""16-bit weights on the wire with float32 masters at both ends (engine.fl.wire_precision)."""

import pytest
import torch
from testsupport import random_split

from engine.errors import ConfigError, WeightsError
from engine.federation.flower import records
from engine.federation.inprocess import run_rounds
from engine.fl.methods import FedAvg, FedSM, SiteRuntime
from engine.fl.wire_precision import (
    DownCache,
    check_wire_precision,
    decode_down,
    decode_up,
    encode_down,
    encode_up,
)
from engine.tasks import FUNDUS

PARTS = frozenset({"global"})


def master() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return {"global": {"w": torch.randn(64, 32), "n": torch.tensor(7)}, "stats": {"s": torch.randn(5) * 1e4}}


def test_down_sends_16_bit_values_of_weight_parts_only():
    sent = encode_down(master(), PARTS)
    assert sent["global"]["w"].dtype == torch.bfloat16
    assert sent["global"]["n"].dtype == torch.int64  # integer buffers travel as they are
    assert sent["stats"]["s"].dtype == torch.float32  # a part outside the wire parts too
    got = decode_down(sent, PARTS)
    assert got["global"]["w"].dtype == torch.float32
    # widening is exact: the site trains from exactly the rounded values
    assert torch.equal(got["global"]["w"], master()["global"]["w"].to(torch.bfloat16).float())
    rel = ((got["global"]["w"] - master()["global"]["w"]).abs() / master()["global"]["w"].abs()).max()
    assert float(rel) <= 2 ** -8


def test_a_shared_part_is_converted_once_per_round():
    m = master()
    cache = DownCache()
    assert encode_down(m, PARTS, cache)["global"] is encode_down(m, PARTS, cache)["global"]


def test_up_carries_differences_added_to_the_float32_master():
    m = master()
    received = decode_down(encode_down(m, PARTS), PARTS)
    trained = {"global": {"w": received["global"]["w"] + 1e-3 * torch.randn(64, 32), "n": torch.tensor(9)},
               "stats": {"s": torch.randn(5)}}
    reply = encode_up(trained, received, PARTS)
    assert reply["global"]["w"].dtype == torch.bfloat16 and reply["global"]["n"].dtype == torch.int64
    assert reply["stats"]["s"].dtype == torch.float32  # what the site did not receive travels as it is
    rebuilt = decode_up(reply, m, PARTS)
    step = trained["global"]["w"] - received["global"]["w"]
    # the master takes the site's step, rounded relative to the step and not to the weights
    err = (rebuilt["global"]["w"] - m["global"]["w"] - step).abs()
    assert float((err / step.abs().clamp_min(1e-12)).max()) <= 2 ** -8
    assert int(rebuilt["global"]["n"]) == 9 and torch.equal(rebuilt["stats"]["s"], trained["stats"]["s"])


def test_small_steps_accumulate_where_16_bit_weights_would_lose_them():
    """100 rounds of a step 1/2000 of the weight: the master keeps them; rounding the weights each round
    (what sending 16-bit values up would do) loses every one."""
    m = {"global": {"w": torch.full((8,), 1.0)}}
    naive = m["global"]["w"].clone()
    for _ in range(100):
        received = decode_down(encode_down(m, PARTS), PARTS)
        trained = {"global": {"w": received["global"]["w"] + 5e-4}}
        m = {"global": decode_up(encode_up(trained, received, PARTS), m, PARTS)["global"]}
        naive = (naive + 5e-4).to(torch.bfloat16).float()
    assert torch.allclose(m["global"]["w"], torch.full((8,), 1.05), atol=1e-4)
    assert torch.equal(naive, torch.full((8,), 1.0))


def test_a_reply_that_skips_the_16_bit_difference_is_refused():
    m = master()
    bad = {"global": {"w": m["global"]["w"].clone(), "n": torch.tensor(7)}}  # float32 where a difference belongs
    with pytest.raises(WeightsError, match=r"has dtype torch\.float32; it must travel as the bfloat16 difference"):
        decode_up(bad, m, PARTS, "reply from site2")
    wrong_shape = {"global": {"w": torch.zeros(3, dtype=torch.bfloat16), "n": torch.tensor(7)}}
    with pytest.raises(WeightsError, match=r"reply from site2: global/w has shape \(3,\), expected \(64, 32\)"):
        decode_up(wrong_shape, m, PARTS, "reply from site2")


def test_bfloat16_travels_as_its_bits_through_flower_records():
    w = {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(2), "c": torch.tensor(3)}
    record, layout = records.pack(w)
    assert set(record) == {"bfloat16", "float32", "int64"}
    back = records.unpack(record, layout, "test")
    for key, value in w.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value)


def test_setting_is_checked():
    assert check_wire_precision("float32") == "float32"
    with pytest.raises(ConfigError, match="bfloat16"):
        check_wire_precision("float8")


def sites() -> list[SiteRuntime]:
    return [SiteRuntime(f"site{k + 1}", k, random_split(4 + 2 * k, seed=k, shift=0.3 * k),
                        validation=random_split(3, seed=10 + k, shift=0.3 * k)) for k in range(3)]


def _run(method, rounds):
    return run_rounds(method, sites(), rounds)


def test_fedavg_halves_its_bytes_and_keeps_its_result(tiny_training):
    names = [s.name for s in sites()]
    s16, rec16 = _run(FedAvg(FUNDUS, names, tiny_training, seed=1).use_wire_precision("bfloat16"), 2)
    s32, rec32 = _run(FedAvg(FUNDUS, names, tiny_training, seed=1).use_wire_precision("float32"), 2)
    for a, b in zip(rec16, rec32, strict=True):
        for site in names:
            assert a.bytes_to_site[site] < 0.51 * b.bytes_to_site[site]
            assert a.bytes_from_site[site] < 0.51 * b.bytes_from_site[site]
    assert all(s16["global"][k].dtype == s32["global"][k].dtype for k in s32["global"])  # float32 masters
    diff = max(float((s16["global"][k].float() - s32["global"][k].float()).abs().max()) for k in s32["global"])
    assert 0 < diff < 1e-2  # rounded on the way, not a different training


def test_fedsm_last_round_travels_exactly(tiny_training):
    names = [s.name for s in sites()]

    def run(precision):
        method = FedSM(FUNDUS, names, tiny_training, seed=0, rounds=1, lam=0.7).use_wire_precision(precision)
        return method, _run(method, method.total_rounds)[1]

    method, r16 = run("bfloat16")
    _, r32 = run("float32")
    assert method.wire_parts(1) == method.WIRE_PARTS
    assert method.wire_parts(method.total_rounds) == frozenset()  # the bundle's models are scored as they are
    assert r16[0].bytes_to_site["site1"] < 0.51 * r32[0].bytes_to_site["site1"]
    assert r16[-1].bytes_to_site["site1"] == r32[-1].bytes_to_site["site1"]
