"""torch's thread count follows the cores that are free."""

from __future__ import annotations

import torch

from engine.threads import free_cores, use_free_cores


def test_free_cores_subtracts_other_load():
    assert free_cores(cores=lambda: 8, load=lambda: 0.2) == 8
    assert free_cores(cores=lambda: 8, load=lambda: 3.4) == 5
    assert free_cores(cores=lambda: 2, load=lambda: 7.0) == 1  # a loaded machine: one thread, never zero
    assert free_cores(cores=lambda: 2, load=lambda: 1.6, own_threads=1) == 1
    assert free_cores(cores=lambda: 4, load=lambda: 2.0, own_threads=2) == 4


def test_use_free_cores_sets_torch_threads_and_honours_omp_num_threads():
    before = torch.get_num_threads()
    try:
        assert use_free_cores({}, cores=lambda: 3, load=lambda: 7.0) == 1
        assert torch.get_num_threads() == 1
        assert use_free_cores({}, cores=lambda: 2, load=lambda: 0.0) == 2
        assert torch.get_num_threads() == 2
        assert use_free_cores({"OMP_NUM_THREADS": "1"}, cores=lambda: 2, load=lambda: 0.0) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
