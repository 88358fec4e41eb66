"""Synthetic DICOM series for tests: written with pydicom, with the canonical study a reader must return.

Shared by the DICOM SEG tests (tests/io) and the inference tests (tests/inference).
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
from pydicom.dataset import FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, MRImageStorage, generate_uid

from engine.io.study import Study


def write_series(
    folder: Path,
    rows: int = 12,
    columns: int = 10,
    slices: int = 4,
    angle_deg: float = 0.0,
    spacing: tuple[float, float] = (0.8, 0.6),
    thickness: float = 2.5,
    seed: int = 0,
    sagittal: bool = False,
) -> tuple[list[Path], np.ndarray]:
    """Write a single-frame MR series (files in shuffled name order); return paths and pixel stacks.

    ``angle_deg`` rotates the image plane about the patient's z axis (an oblique acquisition);
    ``sagittal`` acquires sagittal planes instead (rows run posterior, columns run down).
    Returns the files in slice order and the pixels as ``(slices, rows, columns)``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 1000, (slices, rows, columns), dtype=np.uint16)
    a = np.deg2rad(angle_deg)
    row_dir = np.array([np.cos(a), np.sin(a), 0.0])  # direction of increasing column index
    col_dir = np.array([-np.sin(a), np.cos(a), 0.0])  # direction of increasing row index
    if sagittal:
        row_dir, col_dir = np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, -1.0])
    normal = np.cross(row_dir, col_dir)
    origin = np.array([-30.0, -20.5, 11.0])
    study_uid, series_uid, frame_uid = generate_uid(), generate_uid(), generate_uid()
    paths = []
    order = rng.permutation(slices)  # file names do not follow slice order
    for k in range(slices):
        ds = pydicom.Dataset()
        ds.file_meta = FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.file_meta.MediaStorageSOPClassUID = MRImageStorage
        sop_uid = generate_uid()
        ds.file_meta.MediaStorageSOPInstanceUID = sop_uid
        ds.SOPClassUID = MRImageStorage
        ds.SOPInstanceUID = sop_uid
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study_uid, series_uid, frame_uid
        ds.Modality = "MR"
        ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = "Anon", "P0", "", "O"
        ds.StudyDate, ds.StudyTime, ds.StudyID, ds.AccessionNumber = "20240101", "120000", "1", ""
        ds.ReferringPhysicianName = ""
        ds.Manufacturer = "Synthetic"
        ds.SeriesNumber, ds.InstanceNumber = 3, k + 1
        ds.ImageOrientationPatient = [f"{v:.6f}" for v in (*row_dir, *col_dir)]
        ds.ImagePositionPatient = [f"{v:.6f}" for v in origin + k * thickness * normal]
        ds.PixelSpacing = list(spacing)
        ds.SliceThickness = thickness
        ds.Rows, ds.Columns = rows, columns
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.PixelData = pixels[k].tobytes()
        path = folder / f"img{order[k]:03d}.dcm"
        ds.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths, pixels


def canonical_study(paths: list[Path], pixels: np.ndarray) -> Study:
    """The study a DICOM reader must return for ``paths``: nibabel's closest-canonical RAS+ form.

    Voxel ``(c, r, k)`` (column, row, slice) maps to LPS ``IPP_0 + c*dc*row_dir + r*dr*col_dir +
    k*dz*normal``; flipping x and y gives RAS; ``nib.as_closest_canonical`` reorders the voxels.
    """
    first, second = (pydicom.dcmread(p, stop_before_pixels=True) for p in paths[:2])
    iop = np.array([float(v) for v in first.ImageOrientationPatient])
    dr, dc = (float(v) for v in first.PixelSpacing)
    ipp0 = np.array([float(v) for v in first.ImagePositionPatient])
    step = np.array([float(v) for v in second.ImagePositionPatient]) - ipp0
    lps = np.eye(4)
    lps[:3, 0], lps[:3, 1], lps[:3, 2], lps[:3, 3] = iop[:3] * dc, iop[3:] * dr, step, ipp0
    ras = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps
    data = pixels.transpose(2, 1, 0).astype(np.float32)  # (slices, rows, cols) -> (c, r, k)
    img = nib.as_closest_canonical(nib.Nifti1Image(data, ras))
    array = np.asarray(img.dataobj, dtype=np.float32)
    affine = np.asarray(img.affine)
    # dicom_files follow the canonical k axis: k of each file's first pixel.
    to_voxel = np.linalg.inv(affine)

    def canonical_k(path: Path) -> float:
        ipp = [float(v) for v in pydicom.dcmread(path, stop_before_pixels=True).ImagePositionPatient]
        return float(to_voxel[2] @ np.r_[np.array(ipp) * [-1, -1, 1], 1.0])

    return Study(
        array=array,
        kind="volume",
        affine=affine,
        spacing=tuple(float(s) for s in nib.affines.voxel_sizes(affine)),
        modality="MR",
        source=paths[0].parent,
        source_format="dicom",
        series_uid=str(first.SeriesInstanceUID),
        dicom_files=tuple(sorted(paths, key=canonical_k)),
    )
