"""Qt-free rendering: slice orientation, markers, window/level, photo adjustment, overlays, CDR."""

from __future__ import annotations

import numpy as np
import pytest

from fedsm_gui.models.display import (
    MARKERS,
    adjust_photo,
    apply_window,
    display_shape,
    display_slice,
    display_to_voxel,
    label_outline,
    overlay_lut,
    overlay_rgba,
    pixel_size_mm,
    voxel_to_display,
    window_presets,
)

SHAPE = (7, 5, 4)  # X (to patient's right), Y (anterior), Z (superior)


def marker_volume() -> np.ndarray:
    """Voxel value encodes its index: 100*i + 10*j + k."""
    i, j, k = np.meshgrid(*[np.arange(s) for s in SHAPE], indexing="ij")
    return (100 * i + 10 * j + k).astype(np.float32)


def test_axial_view_is_radiological_right_on_screen_left_anterior_up():
    vol = marker_volume()
    img = display_slice(vol, "axial", 2)
    assert img.shape == display_shape(SHAPE, "axial") == (5, 7)
    # top-left of the screen: most anterior row, patient's rightmost column
    assert img[0, 0] == 100 * 6 + 10 * 4 + 2
    # moving right on screen goes toward the patient's left (i decreases)
    assert img[0, 1] == img[0, 0] - 100
    # moving down goes posterior (j decreases)
    assert img[1, 0] == img[0, 0] - 10
    assert MARKERS["axial"] == ("A", "P", "R", "L")


def test_coronal_and_sagittal_have_superior_up():
    vol = marker_volume()
    cor = display_slice(vol, "coronal", 3)
    assert cor.shape == (4, 7)
    assert cor[0, 0] == 100 * 6 + 10 * 3 + 3  # superior, patient's right
    assert cor[1, 0] == cor[0, 0] - 1  # down = inferior
    sag = display_slice(vol, "sagittal", 1)
    assert sag.shape == (4, 5)
    assert sag[0, 0] == 100 * 1 + 10 * 4 + 3  # superior, anterior on the left
    assert sag[0, 1] == sag[0, 0] - 10  # right = posterior
    assert MARKERS["coronal"] == ("S", "I", "R", "L")
    assert MARKERS["sagittal"] == ("S", "I", "A", "P")


@pytest.mark.parametrize("view", ["axial", "coronal", "sagittal"])
def test_display_and_voxel_coordinates_are_inverse(view):
    vol = marker_volume()
    axis = {"sagittal": 0, "coronal": 1, "axial": 2}[view]
    index = SHAPE[axis] - 2
    img = display_slice(vol, view, index)
    for row in range(img.shape[0]):
        for col in range(img.shape[1]):
            i, j, k = display_to_voxel(view, index, row, col, SHAPE)
            assert img[row, col] == vol[i, j, k]
            assert voxel_to_display(view, (i, j, k), SHAPE) == (row, col)


def test_pixel_size_follows_spacing():
    spacing = (0.5, 0.7, 3.0)
    assert pixel_size_mm(spacing, "axial") == (0.7, 0.5)
    assert pixel_size_mm(spacing, "coronal") == (3.0, 0.5)
    assert pixel_size_mm(spacing, "sagittal") == (3.0, 0.7)


def test_window_maps_level_and_width_to_grey():
    img = np.array([[-100.0, 0.0, 50.0, 100.0, 300.0]], dtype=np.float32)
    out = apply_window(img, center=50.0, width=100.0)
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    assert out.tolist() == [[0, 0, 127, 255, 255]]


def test_presets_include_dicom_default_and_ct_presets():
    arr = np.linspace(-1000, 1000, 1000, dtype=np.float32)
    presets = window_presets("CT", arr, (40.0, 400.0))
    assert next(iter(presets)) == "Default (from file)"
    assert presets["Default (from file)"] == (40.0, 400.0)
    assert "Lung" in presets and "Bone" in presets
    assert "Lung" not in window_presets("MR", arr, None)


def test_photo_green_channel_and_brightness():
    rgb = np.zeros((2, 2, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 90, 10
    green = adjust_photo(rgb, green_only=True)
    assert (green == 90).all()
    brighter = adjust_photo(rgb, brightness=0.1)
    assert brighter[0, 0].tolist() == [225, 115, 35]
    assert adjust_photo(rgb, contrast=2.0)[0, 0].tolist() == [255, 52, 0]


def test_overlay_fill_outline_and_hidden_labels():
    labels = np.zeros((6, 6), dtype=np.uint8)
    labels[1:5, 1:5] = 1
    labels[2:4, 2:4] = 2
    lut = overlay_lut({1: ((255, 0, 0), True), 2: ((0, 255, 0), False)}, opacity=0.5)
    fill = overlay_rgba(labels, lut)
    assert fill[1, 1].tolist() == [255, 0, 0, 128]
    assert fill[2, 2, 3] == 0  # label 2 hidden
    assert fill[0, 0, 3] == 0  # background
    edge = label_outline(labels)
    assert edge[1, 1] and not edge[0, 0]
    assert edge[2, 2]  # label 2's border touches label 1
    outline = overlay_rgba(labels, lut, outline=True)
    assert outline[1, 3, 3] > 0 and outline[1, 3, :3].tolist() == [255, 0, 0]


@pytest.mark.parametrize("budget", [10**9, 0, 2 * 7 * 5 * 4 * 4])
def test_slicer_serves_the_same_slices_contiguously(budget):
    from fedsm_gui.models.display import Slicer

    vol = marker_volume()
    slicer = Slicer(vol, volume=True, budget=budget)
    for view, axis in (("axial", 2), ("coronal", 1), ("sagittal", 0)):
        for index in range(SHAPE[axis]):
            got = slicer.slice(view, index)
            assert np.array_equal(got, display_slice(vol, view, index))
            if view in slicer.copies:
                assert got.flags.c_contiguous
    assert len(slicer.copies) == {10**9: 3, 0: 0}.get(budget, 2)
    photo = np.zeros((4, 5, 3), dtype=np.uint8)
    assert Slicer(photo, volume=False).slice("photo", 0) is photo


def test_slicer_counts_label_values_of_maps_and_photos_masks():
    from fedsm_gui.models.display import Slicer

    labels = np.zeros((6, 5, 4), dtype=np.uint8)
    labels[1, 1, 3] = 7
    labels[2, 2, 0] = 2
    assert Slicer(labels, volume=True).label_values() == (0, 2, 7)
    assert Slicer(labels[:, :, 0], volume=False).label_values() == (0, 2)
