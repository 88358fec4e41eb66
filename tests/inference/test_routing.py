"""FedSM routing rules (paper, Algorithms 2 and 4) on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.inference.routing import (
    case_mean_probabilities,
    check_gamma,
    confidence,
    route_fedsm,
    route_fedsm_extra,
)


def test_fedsm_above_gamma_goes_to_the_personalized_model() -> None:
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.05, 0.85]])
    assert route_fedsm(probs, gamma=0.6).tolist() == [1, 3]


def test_fedsm_equal_to_gamma_goes_to_global() -> None:
    # Algorithm 2 uses a strict "max(p) > gamma".
    probs = np.array([[0.5, 0.5], [0.25, 0.75], [0.75, 0.25]])
    assert route_fedsm(probs, gamma=0.5).tolist() == [0, 2, 1]
    assert route_fedsm(probs, gamma=0.75).tolist() == [0, 0, 0]


def test_fedsm_below_gamma_goes_to_global() -> None:
    probs = np.array([[0.4, 0.35, 0.25]])
    assert route_fedsm(probs, gamma=0.5).tolist() == [0]


def test_fedsm_gamma_extremes() -> None:
    probs = np.array([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    assert route_fedsm(probs, gamma=1.0).tolist() == [0, 0, 0]  # nothing exceeds 1
    assert route_fedsm(probs, gamma=0.0).tolist() == [1, 1, 2]  # ties: lowest site index


def test_fedsm_returns_int64_and_handles_no_images() -> None:
    out = route_fedsm(np.array([[0.9, 0.1]], dtype=np.float32), np.float32(0.5))
    assert out.dtype == np.int64
    empty = route_fedsm(np.zeros((0, 3)), 0.5)
    assert empty.shape == (0,) and empty.dtype == np.int64


def test_fedsm_extra_is_argmax_including_global() -> None:
    probs = np.array(
        [
            [0.6, 0.3, 0.1],  # global
            [0.2, 0.5, 0.3],  # site 1
            [0.1, 0.2, 0.7],  # site 2
            [0.4, 0.4, 0.2],  # tie between global and site 1 -> lower index (global)
        ]
    )
    out = route_fedsm_extra(probs)
    assert out.tolist() == [0, 1, 2, 0]
    assert out.dtype == np.int64


def test_confidence_is_max_probability() -> None:
    probs = np.array([[0.2, 0.8], [0.55, 0.45]], dtype=np.float32)
    np.testing.assert_allclose(confidence(probs), [0.8, 0.55])
    assert confidence(np.zeros((0, 2))).shape == (0,)


@pytest.mark.parametrize("gamma", [-0.1, 1.01, float("nan"), float("inf"), "0.5", None, True])
def test_bad_gamma_is_refused(gamma: object) -> None:
    with pytest.raises(ConfigError, match="gamma"):
        route_fedsm(np.array([[0.5, 0.5]]), gamma)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gamma"):
        check_gamma(gamma)


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2), (2, 0)])
def test_bad_shapes_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="shape"):
        route_fedsm(np.full(shape, 0.5), 0.5)
    with pytest.raises(ConfigError, match="shape"):
        confidence(np.full(shape, 0.5))


def test_fedsm_extra_needs_global_plus_one_site() -> None:
    with pytest.raises(ConfigError, match="K \\+ 1"):
        route_fedsm_extra(np.ones((2, 1)))


def test_integer_probabilities_are_refused() -> None:
    with pytest.raises(ConfigError, match="floating"):
        route_fedsm(np.array([[1, 0]]), 0.5)


def test_routing_gamma_is_the_users_when_given_else_the_bundles():
    from engine.inference.routing import routing_gamma

    assert routing_gamma(0.6) == routing_gamma(0.6, None) == 0.6
    assert routing_gamma(0.6, 0.9) == 0.9 and routing_gamma(0.6, 0) == 0.0
    for bad in (1.5, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ConfigError, match="gamma must be"):
            routing_gamma(0.6, bad)


def test_a_volume_is_decided_by_its_slices_mean_probabilities() -> None:
    # slices of case 7 (rows 0, 2, 3) and a photo (case 2, row 1); case ids need not be contiguous or sorted
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7], [0.6, 0.4]], dtype=np.float32)
    mean = case_mean_probabilities(probs, np.array([7, 2, 7, 7]))
    np.testing.assert_allclose(mean, [[0.6, 0.4], [0.2, 0.8], [0.6, 0.4], [0.6, 0.4]], rtol=1e-6)
    assert mean.dtype == np.float32
    # per slice the volume would be split between site 1's and site 2's models; whole, it goes to one
    assert route_fedsm(probs, 0.55).tolist() == [1, 2, 2, 1]
    assert route_fedsm(mean, 0.55).tolist() == [1, 2, 1, 1]
    assert route_fedsm(mean, 0.6).tolist() == [0, 2, 0, 0]
    assert case_mean_probabilities(np.zeros((0, 2), dtype=np.float32), np.zeros(0)).shape == (0, 2)
    with pytest.raises(ConfigError, match="case ids of shape"):
        case_mean_probabilities(probs, np.zeros(3))
