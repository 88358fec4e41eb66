"""The in-memory types every reader returns and every viewer and exporter consumes.

Canonical orientation
---------------------
A volume's voxels are stored in **RAS+ closest-canonical order** (what
:func:`nibabel.as_closest_canonical` produces): ``array[i, j, k]`` with ``i`` increasing toward the
patient's Right, ``j`` toward Anterior, ``k`` toward Superior, whatever the source's own order
(DICOM is LPS, NRRD/MHA are often LPS too). ``affine`` maps ``(i, j, k, 1)`` to RAS+ millimetres,
so ``array[:, :, k]`` is always an axial slice and a NIfTI written with ``affine`` lies exactly on
the image in any viewer. Photos (fundus) stay ``(H, W, 3)`` ``uint8`` in file order.

Viewers derive display orientation from this alone (radiological convention: patient's right on
the screen's left, anterior up); nothing here knows about screens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

StudyKind = Literal["photo", "volume"]


@dataclass(frozen=True)
class SeriesInfo:
    """One choosable series (or single file) found at a path, described without reading pixels.

    Attributes
    ----------
    uid
        DICOM SeriesInstanceUID, or the file path for non-DICOM inputs.
    description
        Human-readable label (series description, or file name).
    modality
        DICOM modality (``"MR"``, ``"CT"``, ``"SEG"``, ...) or ``""`` when unknown.
    count
        Number of slices/files in the series.
    size
        ``(rows, columns)`` of a slice when known from headers, else ``None``.
    """

    uid: str
    description: str
    modality: str
    count: int
    size: tuple[int, int] | None = None


@dataclass(frozen=True, eq=False)
class SourceGrid:
    """The voxel grid of the file a volume was read from, so a writer can map canonical voxels back.

    The viewer and the models work in canonical order; exporters that promise "the mask on the
    source's own grid" (NIfTI export, see docs/io-export.md) write ``to_source(array)`` with
    ``affine``. For NIfTI, MHA and NRRD sources this is the file's voxel order; for a DICOM series
    it is the grid SimpleITK's ``ImageSeriesReader`` gives: ``i`` along the row direction
    (columns), ``j`` along the column direction (rows), ``k`` along the slice normal
    (``row x column`` direction) in increasing position.

    Attributes
    ----------
    shape
        ``(X, Y, Z)`` of the source's voxel array.
    affine
        Voxel -> RAS+ millimetres of the source's voxel order.
    ornt
        nibabel orientation ``(3, 2)``: source axis ``i`` is canonical axis ``ornt[i, 0]``,
        reversed when ``ornt[i, 1] < 0``.
    """

    shape: tuple[int, int, int]
    affine: np.ndarray
    ornt: np.ndarray

    def to_source(self, canonical: np.ndarray) -> np.ndarray:
        """A view of a canonical-order array (``(X, Y, Z)``) in the source's voxel order."""
        return source_view(canonical, self.ornt)


def source_view(canonical: np.ndarray, ornt: np.ndarray) -> np.ndarray:
    """A view of a canonical array in the source's voxel order (writing into it fills ``canonical``).

    Lets a reader fill the canonical array slice by slice in file order, without a second copy.
    """
    from nibabel.orientations import apply_orientation, axcodes2ornt, ornt_transform

    view = apply_orientation(canonical, ornt_transform(axcodes2ornt("RAS"), ornt))
    if not np.shares_memory(view, canonical):  # pragma: no cover - apply_orientation only flips/transposes
        raise AssertionError("orientation view does not share memory")
    return view


@dataclass(frozen=True, eq=False)
class Study:
    """An image ready to show and segment.

    Attributes
    ----------
    array
        ``kind == "volume"``: ``float32 (X, Y, Z)`` in RAS+ canonical voxel order, modality units
        (rescale slope/intercept applied: Hounsfield units for CT).
        ``kind == "photo"``: ``uint8 (H, W, 3)`` RGB in file order.
    kind
        ``"photo"`` or ``"volume"``.
    affine
        ``(4, 4)`` voxel-to-RAS+-millimetre matrix (photos: ``diag(1, 1, 1, 1)``).
    spacing
        Millimetres per voxel along each array axis (photos: ``(1.0, 1.0)``).
    modality
        ``"MR"``, ``"CT"``, ``"OP"`` (ophthalmic photo), ... or ``""`` when the source does not say.
    window
        Default display ``(center, width)``: the DICOM's own when present, else from the data.
    source
        The file or folder it was read from.
    source_format
        ``"dicom"``, ``"nifti"``, ``"mha"``, ``"nrrd"``, ``"png"``, ``"jpeg"``, ``"tiff"``, ``"bmp"``.
    description
        De-identified descriptors only (series description, modality, manufacturer, slice
        thickness, ...): never names, IDs, dates of birth or accession numbers.
    series_uid
        DICOM SeriesInstanceUID when read from DICOM.
    dicom_files
        DICOM only: the source slice files ordered along the canonical ``k`` axis (needed to
        export a DICOM SEG that references the source series).
    source_grid
        Volumes read from a file or series: the source's own voxel grid (:class:`SourceGrid`),
        which NIfTI export writes masks on; ``None`` for photos and studies made in memory.
    """

    array: np.ndarray
    kind: StudyKind
    affine: np.ndarray
    spacing: tuple[float, ...]
    modality: str = ""
    window: tuple[float, float] | None = None
    source: Path | None = None
    source_format: str = ""
    description: dict[str, str] = field(default_factory=dict)
    series_uid: str | None = None
    dicom_files: tuple[Path, ...] = ()
    source_grid: SourceGrid | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """Spatial shape: ``(X, Y, Z)`` for volumes, ``(H, W)`` for photos."""
        return tuple(self.array.shape[:3]) if self.kind == "volume" else tuple(self.array.shape[:2])

    @property
    def num_slices(self) -> int:
        """Images the super model segments: axial slices of a volume, 1 for a photo."""
        return int(self.array.shape[2]) if self.kind == "volume" else 1


@dataclass(frozen=True, eq=False)
class LabelMap:
    """A mask aligned voxel for voxel with a :class:`Study`.

    Attributes
    ----------
    array
        ``uint8``, shape ``study.shape``; 0 is background.
    names
        Label value -> structure name (e.g. ``{1: "rim", 2: "cup"}`` or ``{1: "prostate"}``).
    source
        Where it was read from, ``None`` for a model's output.
    """

    array: np.ndarray
    names: dict[int, str]
    source: Path | None = None
