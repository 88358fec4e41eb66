"""Each hostile file of issue 16.5 is refused with an engine error, before it costs memory or time."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import hostile_files as hf
import nibabel as nib
import numpy as np
import pydicom
import pytest
from PIL import Image
from synthetic_dicom import write_series
from testsupport import SHARED_DATA

from engine.errors import BundleError, DataError
from engine.io import guard
from engine.io.files import read_label_png, read_rgb_image
from engine.io.masks import read_mask
from engine.io.readers import list_series, open_study

PROSTATEX = SHARED_DATA / "dicom" / "ProstateX-0000_t2_tse_tra"
needs_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared real data not present")


# --- DICOM -----------------------------------------------------------------------------------------


def test_deflate_bomb_is_refused_while_inflating(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a 40 MiB dataset deflated to a few KiB; the cap lowered to 8 MiB to keep the test fast
    monkeypatch.setattr(guard, "MAX_DICOM_INFLATED_BYTES", 8 << 20)
    bomb = tmp_path / "bomb.dcm"
    bomb.write_bytes(hf.dicom_deflate_bomb(40 << 20))
    assert bomb.stat().st_size < 200_000
    # Execute / Assert: every entry point stops at the cap, in a folder or alone
    for read in (list_series, open_study):
        for target in (bomb, tmp_path):
            with pytest.raises(DataError, match=r"bomb\.dcm: the deflate-compressed DICOM dataset inflates to more "
                                                r"than 8 MiB \(a 'zip bomb'\)"):
                read(target)


@needs_data
def test_deflated_real_slice_still_reads(tmp_path: Path) -> None:
    """The bound does not break a legitimate deflated file: same voxels as the uncompressed slice."""
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    ds = pydicom.dcmread(PROSTATEX / "1-01.dcm")
    ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    (tmp_path / "d").mkdir()
    ds.save_as(tmp_path / "d" / "1-01.dcm", enforce_file_format=True)
    shutil.copy(PROSTATEX / "1-01.dcm", tmp_path / "plain.dcm")
    deflated, plain = open_study(tmp_path / "d"), open_study(tmp_path / "plain.dcm")
    np.testing.assert_array_equal(deflated.array, plain.array)


@needs_data
def test_giant_dicom_header_is_refused_before_reserving_memory(tmp_path: Path) -> None:
    ds = pydicom.dcmread(PROSTATEX / "1-01.dcm")
    ds.Rows, ds.Columns = 65535, 65535
    ds.save_as(tmp_path / "giant.dcm", enforce_file_format=True)
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"65535x65535 pixels \(4,294,836,225 voxels\), more than the 1,000,000,000"):
        open_study(tmp_path / "giant.dcm")
    assert time.perf_counter() - start < 5


@needs_data
def test_jpeg2000_frame_larger_than_its_header_is_refused(tmp_path: Path) -> None:
    """A real JPEG 2000 CT slice whose codestream (SIZ) declares 8192 columns against the header's 512."""
    import struct

    source = sorted((SHARED_DATA / "dicom" / "TotalSegmentator_example_ct_dicom").iterdir())[0]
    data = bytearray(source.read_bytes())
    at = data.find(b"\xff\x4f\xff\x51")
    assert at > 0 and guard.codestream_size(bytes(data[at:at + 64])) == (512, 512)
    struct.pack_into(">I", data, at + 8, 8192)  # Xsiz
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / source.name).write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"the compressed frame is 8192x512 pixels but the header says 512x512"):
        open_study(tmp_path / "ct")


def test_pixel_budget_and_codestream_size() -> None:
    with pytest.raises(DataError, match=r"x\.dcm: the header declares 100000 frame\(s\) of 512x512 pixels"):
        guard.check_pixel_budget("x.dcm", 512, 512, 100_000, 16)
    assert guard.check_pixel_budget("x.dcm", 512, 512, 10, 16) == 512 * 512 * 10 * 2
    with pytest.raises(DataError, match="declares 0 frame"):
        guard.check_pixel_budget("x.dcm", 512, 512, 0, 16)
    for fmt in ("JPEG", "JPEG2000"):
        buffer = io.BytesIO()
        Image.new("L", (37, 21)).save(buffer, format=fmt)
        assert guard.codestream_size(buffer.getvalue()) == (37, 21), fmt


@needs_data
@pytest.mark.parametrize(("mutation", "seed"), [(hf.dicom_unknown_vr, 929), (hf.dicom_length_edit, 3)])
def test_damaged_dicom_values_are_data_errors(tmp_path: Path, mutation: hf.Mutation, seed: int) -> None:
    """Unknown VRs (pydicom: NotImplementedError) and wrong value lengths (BytesLengthException)."""
    raw = (PROSTATEX / "1-01.dcm").read_bytes()
    for n in range(20):  # mutations of real files: some still parse; at least one must be refused
        path = tmp_path / f"s{n}" / "slice.dcm"
        path.parent.mkdir()
        path.write_bytes(mutation(raw, np.random.default_rng(seed + n)))
        for read in (open_study, list_series):
            try:
                read(path)
            except DataError as exc:
                assert "slice.dcm" in str(exc)


def test_unknown_vr_in_a_series_is_named(tmp_path: Path) -> None:
    paths, _ = write_series(tmp_path / "s", slices=3)
    data = bytearray(paths[1].read_bytes())
    at = data.find(b"DS", 132)  # the first decimal string after the meta group
    data[at:at + 2] = b"ZZ"
    paths[1].write_bytes(bytes(data))
    try:
        open_study(tmp_path / "s")
    except DataError as exc:
        assert paths[1].name in str(exc)


# --- images ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reader", [read_rgb_image, read_label_png, open_study, list_series])
def test_png_bomb_is_refused_before_decoding(tmp_path: Path, reader: object) -> None:
    # 144 megapixels declared in a ~150 KB file: more than FedSM's cap, less than Pillow's own error limit
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(hf.png_bomb(12_000, 12_000))
    start = time.perf_counter()
    if reader is list_series:
        with pytest.raises(DataError, match=r"bomb\.png: the image is 12000x12000 pixels \(144\.0 megapixels\)"):
            list_series(bomb)
    else:
        with pytest.raises(DataError, match=r"bomb\.png: the (label )?image is 12000x12000 pixels"):
            reader(bomb)  # type: ignore[operator]
    assert time.perf_counter() - start < 2


def test_pillow_bomb_error_and_broken_png_are_data_errors(tmp_path: Path) -> None:
    huge = tmp_path / "huge.png"
    huge.write_bytes(hf.png_bomb(30_000, 30_000, rows=4))  # 900 Mpx: past Pillow's DecompressionBombError limit
    broken = tmp_path / "broken.png"
    good = io.BytesIO()
    Image.fromarray(np.zeros((30, 30), np.uint8)).save(good, format="PNG")
    data = bytearray(good.getvalue())
    data[40] ^= 0xFF  # inside IDAT: "broken PNG file" / decompression error
    broken.write_bytes(bytes(data))
    photo = open_study(_write_png(tmp_path / "eye.png", (30, 30)))
    for path in (huge, broken):
        for read in (read_rgb_image, read_label_png, open_study, lambda p: read_mask(p, photo)):
            with pytest.raises(DataError, match=path.name):
                read(path)


def _write_png(path: Path, size: tuple[int, int]) -> Path:
    Image.fromarray(np.zeros((*size, 3), np.uint8)).save(path)
    return path


# --- NIfTI -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["srow", "qform"])
def test_nifti_with_nan_orientation(tmp_path: Path, where: str) -> None:
    import struct

    path = tmp_path / "v.nii"
    nib.save(nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), np.eye(4)), str(path))
    data = bytearray(path.read_bytes())
    if where == "srow":  # sform in use, srow_x[0] = NaN (offsets of the NIfTI-1 header)
        struct.pack_into("<h", data, 254, 1)
        struct.pack_into("<f", data, 280, float("nan"))
    else:  # qform only, quatern_b = NaN
        struct.pack_into("<hh", data, 252, 1, 0)
        struct.pack_into("<f", data, 256, float("nan"))
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"v\.nii: the (voxel-to-world transform|NIfTI orientation)"):
        open_study(path)
    with pytest.raises(DataError, match=r"v\.nii"):
        list_series(path)


def test_nifti_gzip_bomb_after_the_voxels(tmp_path: Path) -> None:
    """A small .nii.gz whose stream inflates to 64 MiB of zeros past its voxels: refused after 16 MiB."""
    import gzip

    plain = tmp_path / "v.nii"
    nib.save(nib.Nifti1Image(np.zeros((4, 5, 6), np.float32), np.eye(4)), str(plain))
    bomb = tmp_path / "v.nii.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as out:
        out.write(plain.read_bytes())
        for _ in range(64):
            out.write(bytes(1 << 20))
    assert bomb.stat().st_size < 200_000
    with pytest.raises(DataError, match=r"v\.nii\.gz: more than 16 MiB of compressed data follow the voxels"):
        open_study(bomb)


# --- JSON: bundles and datalists ---------------------------------------------------------------------


def _bundle(tmp_path: Path, fedsm: object) -> Path:
    path = tmp_path / "model.safetensors"
    header = {"__metadata__": {"fedsm": fedsm}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    path.write_bytes(hf.safetensors_with_header(header) + b"\x00" * 4)
    return path


def _valid_metadata() -> dict[str, object]:
    from engine.bundle.supermodel import BundleMetadata

    return json.loads(BundleMetadata(task="fundus", label_names=["disc", "cup"], in_channels=3, image_size=32,
                                     selector_size=32, site_names=["a", "b"]).to_json())


@pytest.mark.parametrize(("fedsm", "message"), [
    (123, r"has no 'fedsm' metadata"),
    ("123", r"was not written by FedSM"),
    ("[" * 5000 + "]" * 5000, r"JSON nested 5000 levels deep, more than the 64"),
    ({"task": "fundus"}, r"has no 'fedsm' metadata"),
])
def test_bundle_metadata_of_the_wrong_shape(tmp_path: Path, fedsm: object, message: str) -> None:
    from engine.bundle.supermodel import read_metadata

    with pytest.raises(BundleError, match=message):
        read_metadata(_bundle(tmp_path, fedsm))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("site_names", 5, r"field 'site_names' is invalid: 5 \(5 is not of type 'array'\)"),
    ("val_dice", [1], r"field 'val_dice' is invalid"),
    ("label_names", ["disc", 3], r"field 'label_names/1' is invalid: 3"),
    ("extra", "x", r"field 'extra' is invalid"),
    ("in_channels", True, r"field 'in_channels' is invalid: True"),
])
def test_bundle_metadata_schema(tmp_path: Path, field: str, value: object, message: str) -> None:
    from engine.bundle.supermodel import read_metadata

    meta = _valid_metadata()
    meta[field] = value
    with pytest.raises(BundleError, match=message):
        read_metadata(_bundle(tmp_path, json.dumps(meta)))


def test_deep_safetensors_header_and_deep_datalist(tmp_path: Path) -> None:
    from engine.bundle.supermodel import read_metadata
    from engine.data.datalist import load_datalist

    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(hf.safetensors_with_header("[" * 100_000 + "]" * 100_000))
    with pytest.raises(BundleError, match="nested 100000 levels"):
        read_metadata(deep)
    datalist = tmp_path / "datalist.json"
    datalist.write_text('{"training": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match=r"datalist\.json: JSON nested 100001 levels deep"):
        load_datalist(datalist)


def test_json_depth_ignores_brackets_in_strings() -> None:
    assert guard.json_depth('{"a": "[[[[", "b": [1, {"c": "\\"]]"}]}') == 3
    assert guard.load_json('{"a": [1]}', "x") == {"a": [1]}
    with pytest.raises(DataError, match="x: not valid JSON"):
        guard.load_json("{", "x")


# --- CLI ------------------------------------------------------------------------------------------


def _infer(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from engine.cli.main import main

    code = main(["infer", *args, "--device", "cpu"])  # any non-engine exception would escape here
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_fedsm_infer_gives_one_line_for_hostile_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fedsm infer`` with hostile bundles, then hostile inputs: exit 2 and one ``error:`` line each."""
    photo = _write_png(tmp_path / "eye.png", (40, 40))
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(hf.safetensors_with_header("[" * 50_000 + "]" * 50_000))
    meta = _valid_metadata()
    meta["site_names"] = {"a": 1}
    (tmp_path / "schema").mkdir()
    for bundle in (_bundle(tmp_path, 123), deep, _bundle(tmp_path / "schema", json.dumps(meta))):
        code, err = _infer(capsys, "--model", str(bundle), "--input", str(photo), "--out", str(tmp_path / "o"))
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    model = hf.write_small_bundle(tmp_path / "fundus.safetensors", "fundus")
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / "bomb.png").write_bytes(hf.png_bomb(12_000, 12_000))
    for target in (hostile / "bomb.png", hostile):
        code, err = _infer(capsys, "--model", str(model), "--input", str(target), "--out", str(tmp_path / "o2"))
        assert code == 2 and "bomb.png" in err and "12000x12000" in err, err


def test_split_bundle_metadata_of_the_wrong_shape() -> None:
    from engine.bundle.split import SPLIT_FORMAT, SplitMetadata

    with pytest.raises(BundleError, match="JSON nested 5000 levels deep"):
        SplitMetadata.from_json("[" * 5000 + "]" * 5000)
    with pytest.raises(BundleError, match="format_version 'x' is not an integer"):
        SplitMetadata.from_json(json.dumps({"format": SPLIT_FORMAT, "format_version": "x"}))
    with pytest.raises(BundleError, match="not JSON text"):
        SplitMetadata.from_json(123)  # type: ignore[arg-type]


def test_png_mask_with_a_crafted_provenance_chunk(tmp_path: Path) -> None:
    """A label PNG whose fedsm:provenance chunk is nested 100000 deep still reads as a mask."""
    from PIL.PngImagePlugin import PngInfo

    from engine.io.export import PNG_KEY, read_provenance

    info = PngInfo()
    info.add_itxt(PNG_KEY, "[" * 100_000 + "]" * 100_000)
    mask = tmp_path / "m.png"
    Image.fromarray(np.zeros((30, 30), np.uint8)).save(mask, pnginfo=info)
    photo = open_study(_write_png(tmp_path / "eye.png", (30, 30)))
    assert read_mask(mask, photo).labels.array.shape == (30, 30)
    with pytest.raises(DataError, match=r"m\.png \(fedsm:provenance chunk\): provenance: JSON nested 100000 levels"):
        read_provenance(mask)
