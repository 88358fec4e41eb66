"""Medical image I/O: photos, volumes and DICOM series as studies, masks on them, mask export.

Modules:

- :mod:`~engine.io.study`: the types every reader returns, :class:`Study` (an image in canonical
  order), :class:`LabelMap` (a mask on it) and :class:`SeriesInfo` (what a path holds);
- :mod:`~engine.io.readers`: :func:`open_study`, :func:`list_series`, :func:`detect_format`, the
  one entry point for every format below;
- :mod:`~engine.io.photos` (PNG, JPEG, TIFF, BMP), :mod:`~engine.io.volumes` (NIfTI, MHA/MHD,
  NRRD/NHDR), :mod:`~engine.io.dicom_series` (DICOM folders and files);
- :mod:`~engine.io.masks`: :func:`open_mask`, and :func:`read_mask` giving a :class:`MaskReading`
  (label images, label volumes, DICOM label series and SEGs, onto an opened study);
- :mod:`~engine.io.dicom_seg`: :func:`read_dicom_seg`, :func:`write_dicom_seg`;
- :mod:`~engine.io.export`: :func:`export_mask` (NIfTI, PNG, DICOM SEG) and
  :func:`read_provenance`, with the :class:`Provenance` record of :mod:`~engine.io.provenance`;
- :mod:`~engine.io.files`: plain PNG and NIfTI readers and writers for training files
  (:func:`read_rgb_image`, :func:`read_label_png`, :func:`read_nifti`, :func:`write_rgb_png`,
  :func:`write_label_png`, :func:`write_nifti`);
- :mod:`~engine.io.atomic`: writes that never leave a half-written file.

Every reader failure is an :class:`engine.errors.DataError` naming the file and what to do.
Importing this package is cheap: pydicom, highdicom, nibabel, SimpleITK and Pillow are imported
inside the functions that use them.
"""

from engine.io.dicom_seg import read_dicom_seg, write_dicom_seg
from engine.io.export import export_mask, read_provenance
from engine.io.files import (
    read_label_png,
    read_nifti,
    read_rgb_image,
    write_label_png,
    write_nifti,
    write_rgb_png,
)
from engine.io.masks import MaskReading, open_mask, read_mask
from engine.io.provenance import Provenance
from engine.io.readers import detect_format, list_series, open_study
from engine.io.study import LabelMap, SeriesInfo, Study

__all__ = [
    "LabelMap",
    "MaskReading",
    "Provenance",
    "SeriesInfo",
    "Study",
    "detect_format",
    "export_mask",
    "list_series",
    "open_mask",
    "open_study",
    "read_dicom_seg",
    "read_label_png",
    "read_mask",
    "read_nifti",
    "read_provenance",
    "read_rgb_image",
    "write_dicom_seg",
    "write_label_png",
    "write_nifti",
    "write_rgb_png",
]
