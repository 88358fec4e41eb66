"""Checks on weight dicts: the one-pass finiteness test agrees with an element-wise one."""

import pytest
import torch

from engine.errors import WeightsError
from engine.fl.weights import all_finite, check_compatible, weighted_sum

BIG = torch.finfo(torch.float32).max


@pytest.mark.parametrize(("values", "finite"), [
    ([1.0, -2.0, 3.0], True),
    ([], True),
    ([1.0, float("nan"), 3.0], False),
    ([1.0, float("inf")], False),
    ([float("-inf"), 2.0], False),
    ([float("inf"), float("-inf")], False),  # the sum is NaN, not infinite
    ([BIG, BIG, -1.0], True),  # the float32 sum overflows, every element is finite
    ([BIG, BIG, float("nan")], False),
])
def test_all_finite_agrees_with_isfinite(values, finite):
    for dtype in (torch.float32, torch.float64, torch.float16):
        tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
        expected = bool(torch.isfinite(tensor).all())
        assert all_finite(tensor) is expected
        if dtype == torch.float32:
            assert expected is finite


def test_check_compatible_names_the_key_that_is_not_finite():
    ref = {"a": torch.zeros(3), "b": torch.zeros(2)}
    with pytest.raises(WeightsError, match="b contains NaN or Inf"):
        check_compatible(ref, {"a": torch.ones(3), "b": torch.tensor([0.0, float("inf")])})
    check_compatible(ref, {"a": torch.full((3,), BIG), "b": torch.full((2,), BIG)})  # large but finite


def test_weighted_sum_accumulates_in_float64():
    # 1e8 + 1 - 1e8 is 0 in float32 arithmetic and 1 in float64
    terms = [({"a": torch.tensor([1e8])}, 1.0), ({"a": torch.tensor([1.0])}, 1.0), ({"a": torch.tensor([1e8])}, -1.0)]
    out = weighted_sum(terms)["a"]
    assert out.dtype == torch.float32 and out.item() == 1.0
    counts = weighted_sum([({"n": torch.tensor([3])}, 0.5), ({"n": torch.tensor([4])}, 0.5)])["n"]
    assert counts.dtype == torch.int64 and counts.item() == 4  # 3.5 rounds to even
