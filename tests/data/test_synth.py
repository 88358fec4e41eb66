"""Synthetic federations: layout, determinism, splits, site sizes, anatomy, site differences, reuse."""

import json
import re

import numpy as np
import pytest

from engine.data import synth
from engine.data.datalist import load_datalist, read_datalist_info
from engine.data.site_data import load_site
from engine.data.synth import (
    FUNDUS_PROFILES,
    PROSTATE_PROFILES,
    existing_federation,
    generate_federation,
    render_fundus,
    render_prostate,
    site_profiles,
    split_counts,
)
from engine.errors import ConfigError
from engine.io.files import read_label_png, read_nifti, read_rgb_image
from engine.tasks import get_task


@pytest.fixture(scope="module")
def fundus3(tmp_path_factory):
    out = tmp_path_factory.mktemp("fundus3")
    messages = []
    paths = generate_federation("fundus", 3, out, image_size=64, seed=0, progress=messages.append)
    return out, paths, messages


@pytest.fixture(scope="module")
def prostate3(tmp_path_factory):
    out = tmp_path_factory.mktemp("prostate3")
    return out, generate_federation("prostate", 3, out, image_size=32, seed=0)


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_layout_datalists_and_federation_record(fundus3):
    out, paths, messages = fundus3
    # Assert: one datalist per site, in order, naming the site and task
    assert paths == [(out / f"site{k}" / "datalist.json").absolute() for k in (1, 2, 3)]
    for k, path in enumerate(paths, start=1):
        info = read_datalist_info(path)
        assert info["name"] == f"site{k}" and info["task"] == "fundus"
        names = [f"case{i:03d}.png" for i in range(FUNDUS_PROFILES[k - 1].cases)]
        assert sorted(p.name for p in (path.parent / "images").iterdir()) == names
        assert sorted(p.name for p in (path.parent / "labels").iterdir()) == names
    record = json.loads((out / "federation.json").read_text())
    assert record["task"] == "fundus" and record["sites"] == 3 and record["image_size"] == 64
    assert record["seed"] == 0 and record["generator_version"] == synth.GENERATOR_VERSION
    assert record["profiles"]["site2"]["gains"] == list(FUNDUS_PROFILES[1].gains)
    assert len(messages) == 3 and "site3" in messages[-1]


def test_same_arguments_give_byte_identical_files(tmp_path, fundus3, prostate3):
    # Execute: generate both tasks again into fresh folders
    out_f, _, _ = fundus3
    out_p, _ = prostate3
    generate_federation("fundus", 3, tmp_path / "f", image_size=64, seed=0)
    generate_federation("prostate", 3, tmp_path / "p", image_size=32, seed=0)
    # Assert: every file identical, byte for byte
    assert _files(tmp_path / "f") == _files(out_f)
    assert _files(tmp_path / "p") == _files(out_p)


def test_another_seed_gives_other_images(tmp_path, fundus3):
    out, _, _ = fundus3
    generate_federation("fundus", 2, tmp_path, image_size=64, seed=1)
    a = read_rgb_image(out / "site1" / "images" / "case000.png")
    b = read_rgb_image(tmp_path / "site1" / "images" / "case000.png")
    assert not np.array_equal(a, b)


def test_splits_are_half_quarter_quarter_disjoint_and_complete(fundus3):
    _, paths, _ = fundus3
    for k, path in enumerate(paths):
        dl = load_datalist(path)
        n = FUNDUS_PROFILES[k].cases
        counts = tuple(len(dl[s]) for s in ("training", "validation", "testing"))
        assert counts == split_counts(n)
        assert counts[0] == n // 2 and min(counts) >= 1
        names = [e["image"].name for s in dl.values() for e in s]
        assert sorted(names) == [f"case{i:03d}.png" for i in range(n)]


def test_split_counts_keep_one_case_per_split():
    assert split_counts(3) == (1, 1, 1)
    assert split_counts(4) == (2, 1, 1)
    assert split_counts(8) == (4, 2, 2)
    assert split_counts(64) == (32, 16, 16)
    with pytest.raises(ConfigError):
        split_counts(2)


@pytest.mark.parametrize("task", ["fundus", "prostate"])
def test_site_sizes_are_unequal_like_the_paper(task):
    # Six sites: largest has 8x the cases of the smallest; K sites take the first K profiles
    cases = [p.cases for p in site_profiles(task, 6)]
    assert cases == sorted(cases) and max(cases) / min(cases) == 8
    assert site_profiles(task, 3) == site_profiles(task, 6)[:3]
    # Beyond six the extra profiles are derived deterministically and stay within the same range
    twelve = site_profiles(task, 12)
    assert twelve == site_profiles(task, 12) and twelve[:6] == site_profiles(task, 6)
    assert all(min(cases) <= p.cases <= max(cases) for p in twelve)
    assert len({p.to_json()["brightness"] for p in twelve}) > 6


def test_fundus_labels_follow_origa_and_anatomy_is_plausible(fundus3):
    _, paths, _ = fundus3
    for path in paths:
        for entry in load_datalist(path)["training"]:
            image = read_rgb_image(entry["image"]).astype(np.float32)
            label = read_label_png(entry["label"])
            assert image.shape == (64, 64, 3) and label.shape == (64, 64)
            assert set(np.unique(label)) == {0, 1, 2}
            # The cup lies inside the disc: no cup pixel touches the background
            cup = label == 2
            padded = np.pad(label, 1)
            shifts = ((0, 1), (0, -1), (1, 0), (-1, 0))
            neighbours = [padded[1 + dy:65 + dy, 1 + dx:65 + dx] for dy, dx in shifts]
            assert not any(np.any(cup & (n == 0)) for n in neighbours)
            # Cup-to-disc ratio (vertical extent) in the realistic range
            disc_rows = np.flatnonzero((label >= 1).any(axis=1))
            cup_rows = np.flatnonzero(cup.any(axis=1))
            ratio = (np.ptp(cup_rows) + 1) / (np.ptp(disc_rows) + 1)
            assert 0.2 <= ratio <= 0.85
            # Dark outside the field of view, bright disc on a darker retina
            lum = image.mean(axis=2)
            assert lum[:3, :3].mean() < 12
            retina = (label == 0) & (lum > 20)
            assert lum[label >= 1].mean() > lum[retina].mean() + 10


def test_rendered_cup_to_disc_ratio_covers_the_clinical_range():
    ratios = [render_fundus(np.random.default_rng([0, 0, 1, i]), FUNDUS_PROFILES[0], 32)[2].cup_to_disc
              for i in range(40)]
    assert 0.3 <= min(ratios) < 0.4 and 0.6 < max(ratios) <= 0.7


def test_prostate_volumes_have_gland_in_middle_slices_only(prostate3):
    out, paths = prostate3
    for path in paths:
        for entry in load_datalist(path)["training"]:
            volume, affine = read_nifti(entry["image"])
            label, label_affine = read_nifti(entry["label"])
            assert volume.shape == (32, 32, 12) and label.shape == volume.shape
            assert volume.dtype == np.float32
            assert np.allclose(np.diag(affine)[:3], [4.0, 4.0, 3.0]) and np.allclose(affine, label_affine)
            assert set(np.unique(label)) == {0.0, 1.0}
            per_slice = label.sum(axis=(0, 1))
            assert per_slice[0] == 0 and per_slice[-1] == 0 and per_slice[5:7].min() > 0
            # The gland is darker than the fat around it
            gland = label > 0
            ring = np.zeros_like(gland)
            for dy, dx in ((2, 0), (-2, 0), (0, 2), (0, -2)):
                ring |= np.roll(gland, (dy, dx), axis=(0, 1))
            ring &= ~gland
            assert volume[gland].mean() < volume[ring].mean()
    # Files are written with the NIfTI dtypes the readers expect
    import nibabel as nib

    assert nib.load(str(out / "site1" / "labels" / "case000.nii.gz")).get_data_dtype() == np.uint8


def _area_ratio(profile, task, n=16, size=64):
    """Mean annotated area (volume) over the analytically rendered one."""
    ratios = []
    for i in range(n):
        rng = np.random.default_rng([7, 0, 1, i])
        if task == "fundus":
            _, label, anat = render_fundus(rng, profile, size)
            true = np.pi * anat.disc_radii[0] * anat.disc_radii[1] * (size / 2) ** 2
            ratios.append((label >= 1).sum() / true)
        else:
            _, label, anat = render_prostate(rng, profile, size)
            ry, rx, rz = anat.radii
            ratios.append(label.sum() / (4 / 3 * np.pi * ry * rx * rz * (size / 2) ** 2))
    return float(np.mean(ratios))


@pytest.mark.parametrize(("task", "profiles"), [("fundus", FUNDUS_PROFILES), ("prostate", PROSTATE_PROFILES)])
def test_annotation_habit_draws_the_boundary_wider_at_one_site(task, profiles):
    # Same anatomy (same random streams) rendered under every site's habit
    ratios = [_area_ratio(p, task) for p in profiles]
    wide = int(np.argmax([p.outer for p in profiles]))
    assert ratios[wide] > 1.15
    assert all(ratios[wide] > r + 0.1 for k, r in enumerate(ratios) if k != wide)
    neutral = [r for p, r in zip(profiles, ratios, strict=True) if p.outer == 0]
    assert all(0.9 < r < 1.1 for r in neutral)


def test_cup_habit_enlarges_only_the_cup():
    base = FUNDUS_PROFILES[0]
    wide_cup = FUNDUS_PROFILES[1]
    assert wide_cup.inner > 0 and base.inner == 0
    cups = []
    for profile in (base, wide_cup):
        # Identical anatomy and acquisition, only the annotation habit differs
        neutral = synth.SiteProfile(**{**profile.__dict__, "gains": base.gains})
        labels = [render_fundus(np.random.default_rng([3, 0, 1, i]), neutral, 64)[1] for i in range(12)]
        cups.append(np.mean([(lab == 2).sum() for lab in labels]))
    assert cups[1] > 1.1 * cups[0]


def _features(images):
    body = (images > 0.05).mean(axis=(1, 2, 3))[:, None]
    edges = np.abs(np.diff(images, axis=-1)).mean(axis=(1, 2, 3))[:, None]
    return np.concatenate([images.mean(axis=(2, 3)), images.std(axis=(2, 3)), body, 5 * edges], axis=1)


@pytest.mark.parametrize(("task", "min_accuracy"), [("fundus", 0.95), ("prostate", 0.8)])
def test_sites_are_told_apart_at_low_resolution(tmp_path, task, min_accuracy):
    # Prepare: six sites at 32 px, through the real files and the training loader
    paths = generate_federation(task, 6, tmp_path, image_size=32, seed=0)
    sites = [load_site(p, get_task(task), 32) for p in paths]
    feats = [_features(np.concatenate([s.train.images, s.validation.images, s.test.images])) for s in sites]
    # Execute: nearest site centroid on simple image statistics
    centroids = np.stack([f.mean(axis=0) for f in feats])
    scale = np.concatenate(feats).std(axis=0)
    accuracy = []
    for k, f in enumerate(feats):
        dist = (((f[:, None] - centroids[None]) / scale) ** 2).sum(axis=-1)
        accuracy.append(float((dist.argmin(axis=1) == k).mean()))
    # Assert: every site recognisable, and for fundus the mean colours clearly apart
    assert np.mean(accuracy) >= min_accuracy and min(accuracy) >= 0.6, accuracy
    if task == "fundus":
        means = np.stack([np.concatenate([s.train.images, s.test.images]).mean(axis=(0, 2, 3))
                          for s in sites])
        gaps = np.linalg.norm(means[:, None] - means[None], axis=-1) + np.eye(6)
        assert gaps.min() > 0.03


def test_existing_federation_matches_only_the_same_request(fundus3, tmp_path):
    out, paths, _ = fundus3
    assert existing_federation(out, "fundus", 3, 64, 0) == paths
    assert existing_federation(out, "fundus", 3, 64, 1) is None
    assert existing_federation(out, "fundus", 4, 64, 0) is None
    assert existing_federation(out, "fundus", 3, 128, 0) is None
    assert existing_federation(out, "prostate", 3, 64, 0) is None
    assert existing_federation(tmp_path, "fundus", 3, 64, 0) is None
    (tmp_path / "federation.json").write_text("{broken")
    assert existing_federation(tmp_path, "fundus", 3, 64, 0) is None


def test_existing_federation_needs_every_file(tmp_path):
    paths = generate_federation("fundus", 2, tmp_path, image_size=32, seed=0)
    assert existing_federation(tmp_path, "fundus", 2, 32, 0) == paths
    (tmp_path / "site2" / "labels" / "case003.png").unlink()
    assert existing_federation(tmp_path, "fundus", 2, 32, 0) is None


def test_interrupted_generation_is_never_taken_for_complete_data(tmp_path, monkeypatch):
    # Prepare: complete data for seed 0, then a run for seed 1 that crashes half-way
    generate_federation("fundus", 2, tmp_path, image_size=32, seed=0)
    calls = {"n": 0}
    real = synth.write_label_png

    def crash_after_five(path, labels):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        real(path, labels)

    monkeypatch.setattr(synth, "write_label_png", crash_after_five)
    # Execute
    with pytest.raises(KeyboardInterrupt):
        generate_federation("fundus", 2, tmp_path, image_size=32, seed=1)
    # Assert: neither the old nor the new request matches the mixed folder
    assert not (tmp_path / "federation.json").exists()
    assert existing_federation(tmp_path, "fundus", 2, 32, 0) is None
    assert existing_federation(tmp_path, "fundus", 2, 32, 1) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "xray"}, "unknown task"),
        ({"sites": 1}, "sites must be"),
        ({"sites": 13}, "sites must be"),
        ({"image_size": 40}, "multiple of 16"),
        ({"image_size": 16}, "at least 32"),
        ({"seed": -1}, "seed"),
        ({"slices": 3}, "slices"),
    ],
)
def test_bad_arguments_raise_config_error(tmp_path, kwargs, message):
    args = {"task": "fundus", "sites": 2, "out_dir": tmp_path, "image_size": 32, "seed": 0, **kwargs}
    with pytest.raises(ConfigError, match=message):
        generate_federation(**args)
    assert not any(tmp_path.iterdir())


def _table_rows(task):
    """The profile table as documented in the module docstring."""
    doc = synth.__doc__
    start = doc.index("Fundus (" if task == "fundus" else "Prostate (")
    block = doc[start:].split("::", 1)[1].split("\n\n")[1]
    rows = [line for line in block.strip().splitlines() if line.strip()[:1].isdigit()]
    return [[float(x) for x in re.findall(r"[-+]?\d+\.?\d*", line)] for line in rows]


@pytest.mark.parametrize(("task", "profiles"), [("fundus", FUNDUS_PROFILES), ("prostate", PROSTATE_PROFILES)])
def test_documented_profile_table_matches_the_code(task, profiles):
    for row, p in zip(_table_rows(task), profiles, strict=True):
        colour = list(p.gains) if task == "fundus" else [p.scale, p.offset]
        expected = [p.cases, *colour, p.brightness, p.gamma, p.blur, p.fov, p.jitter, p.noise, p.bias,
                    p.outer, p.inner]
        assert np.allclose(row[1:], expected), (row, p)


def test_prostate_volumes_are_in_ras_order_so_a_diagonal_affine_places_the_anatomy():
    """Axis 0 runs left-right (the pelvis is wider that way, the femoral heads lie on it), axis 1
    posterior-anterior: the drawing's row (anterior up) and column (patient's right on the left)
    land on RAS+ indices as a radiologist would read them."""
    size = 64
    rng = np.random.default_rng([3, 0, 1, 0])
    volume, label, anat = render_prostate(rng, PROSTATE_PROFILES[0], size)
    middle = volume[:, :, volume.shape[2] // 2]
    body = middle > 0.2 * middle.max()
    assert body.any(axis=1).sum() > body.any(axis=0).sum() + 5  # wider along x than along y
    row_c, col_c, _ = anat.centre
    to_index = lambda c: (c + 1.0) / 2.0 * size - 0.5  # noqa: E731  drawing coordinate -> pixel
    i, j, _ = np.argwhere(label).mean(axis=0)
    assert abs(i - (size - 1 - to_index(col_c))) < 1.0  # columns grow to the patient's left = -x
    assert abs(j - (size - 1 - to_index(row_c))) < 1.0  # rows grow posteriorly = -y


def test_cases_scale_multiplies_every_site_keeping_each_case_and_is_part_of_the_match(fundus3, tmp_path):
    out, _, _ = fundus3
    paths = generate_federation("fundus", 3, tmp_path, image_size=64, seed=0, cases_scale=2)
    for k, (path, profile) in enumerate(zip(paths, FUNDUS_PROFILES[:3], strict=True)):
        sections = load_datalist(path)
        assert sum(len(v) for v in sections.values()) == 2 * profile.cases
        counts = [len(sections[s]) for s in ("training", "validation", "testing")]
        assert counts == list(split_counts(2 * profile.cases))
        # case i is the same image at every scale
        same = f"site{k + 1}/images/case000.png"
        assert (tmp_path / same).read_bytes() == (out / same).read_bytes()
    assert existing_federation(tmp_path, "fundus", 3, 64, 0, cases_scale=2) == paths
    assert existing_federation(tmp_path, "fundus", 3, 64, 0) is None
    assert existing_federation(out, "fundus", 3, 64, 0, cases_scale=2) is None
    with pytest.raises(ConfigError, match="cases_scale"):
        generate_federation("fundus", 3, tmp_path / "x", image_size=32, cases_scale=0)
