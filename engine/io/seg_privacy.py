"""What a FedSM DICOM SEG copies from its source series: the patient and study attributes a SEG requires.

highdicom's :class:`~highdicom.seg.Segmentation` copies from the first source image the Patient
module (including type 3 attributes such as ``PatientComments``), the Patient Study module
(age, size, weight), the General Study module and, in ``ContributingEquipmentSequence``, the
source's equipment (``InstitutionName``, ``InstitutionAddress``, ``StationName``,
``DeviceSerialNumber``). A mask needs none of the optional ones, so FedSM:

1. hands highdicom *reduced copies* of the source headers (:func:`minimal_source`): geometry, UIDs,
   and only :data:`COPIED_PATIENT_STUDY` of the patient/study attributes;
2. removes from the built SEG every attribute of :data:`REMOVED` (top level and inside
   ``ContributingEquipmentSequence``), in case a highdicom version copies more.

docs/io-export.md lists the attributes copied.
"""

from __future__ import annotations

import copy
from typing import Any

#: Patient / study attributes a SEG carries (Patient and General Study modules, type 1 and 2; the
#: de-identification flags so a de-identified source stays marked as such).
COPIED_PATIENT_STUDY = (
    "PatientName", "PatientID", "PatientBirthDate", "PatientSex",
    "StudyInstanceUID", "StudyDate", "StudyTime", "ReferringPhysicianName", "StudyID", "AccessionNumber",
    "PatientIdentityRemoved", "DeidentificationMethod", "DeidentificationMethodCodeSequence",
)
#: Everything else highdicom needs from a source image: identity of the instance and its geometry.
_SOURCE_STRUCTURE = (
    "SpecificCharacterSet", "SOPClassUID", "SOPInstanceUID", "SeriesInstanceUID", "Modality", "SeriesNumber",
    "InstanceNumber", "FrameOfReferenceUID", "PositionReferenceIndicator", "ImageType", "Rows", "Columns",
    "SamplesPerPixel", "PhotometricInterpretation", "BitsAllocated", "BitsStored", "HighBit",
    "PixelRepresentation", "PixelSpacing", "ImageOrientationPatient", "ImagePositionPatient", "SliceThickness",
    "SpacingBetweenSlices", "NumberOfFrames", "SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence",
    "DimensionOrganizationSequence", "DimensionIndexSequence", "ContentDate", "ContentTime", "Laterality",
    "ImageLaterality", "FrameOfReferenceUID", "TotalPixelMatrixRows", "TotalPixelMatrixColumns",
)
#: Removed from a built SEG wherever they occur (top level, contributing equipment): identities of
#: people, places and devices, and patient facts a mask does not need.
REMOVED = (
    "PatientComments", "PatientAge", "PatientSize", "PatientWeight", "PatientAddress", "PatientTelephoneNumbers",
    "OtherPatientIDs", "OtherPatientIDsSequence", "OtherPatientNames", "PatientBirthName", "PatientMotherBirthName",
    "MedicalRecordLocator", "EthnicGroup", "Occupation", "AdditionalPatientHistory", "PatientBirthTime",
    "StudyDescription", "AdmittingDiagnosesDescription", "PhysiciansOfRecord", "NameOfPhysiciansReadingStudy",
    "PerformingPhysicianName", "OperatorsName", "RequestingPhysician",
    "InstitutionName", "InstitutionAddress", "InstitutionalDepartmentName", "InstitutionCodeSequence",
    "StationName", "DeviceSerialNumber", "DeviceUID",
)


def minimal_source(ds: Any) -> Any:
    """A copy of a source header holding only what highdicom needs and what a SEG may copy."""
    from pydicom.dataset import Dataset, FileMetaDataset

    out = Dataset()
    meta = getattr(ds, "file_meta", None)
    if meta is not None:
        out.file_meta = FileMetaDataset(copy.deepcopy(meta))
    for keyword in (*_SOURCE_STRUCTURE, *COPIED_PATIENT_STUDY):
        if keyword in ds:
            out[keyword] = copy.deepcopy(ds[keyword])
    out.is_little_endian = getattr(ds, "is_little_endian", True)
    out.is_implicit_VR = getattr(ds, "is_implicit_VR", False)
    return out


def strip_identifiers(seg: Any, keep: tuple[str, ...] = ()) -> None:
    """Delete :data:`REMOVED` attributes (but ``keep``) from ``seg`` and its contributing-equipment items."""
    targets = [seg, *list(seg.get("ContributingEquipmentSequence") or [])]
    for dataset in targets:
        for keyword in REMOVED:
            if keyword in dataset and not (dataset is seg and keyword in keep):
                del dataset[keyword]
