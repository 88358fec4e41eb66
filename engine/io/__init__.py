"""Reading and writing image files (PNG photos and label maps, NIfTI volumes)."""

from engine.io.files import (
    read_label_png,
    read_nifti,
    read_rgb_image,
    write_label_png,
    write_nifti,
    write_rgb_png,
)

__all__ = [
    "read_label_png",
    "read_nifti",
    "read_rgb_image",
    "write_label_png",
    "write_nifti",
    "write_rgb_png",
]
