"""Super-model bundles: one ``.safetensors`` file holding global, personalized and selector weights.

Importing this package does not import torch; :func:`read_metadata` reads a bundle's metadata
without it.
"""

from engine.bundle.supermodel import (
    BUNDLE_FORMAT,
    BUNDLE_FORMAT_VERSION,
    BundleMetadata,
    SuperModelBundle,
    check_bundle_file,
    check_site_name,
    file_sha256,
    load_bundle,
    read_metadata,
    save_bundle,
)

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_FORMAT_VERSION",
    "BundleMetadata",
    "SuperModelBundle",
    "check_bundle_file",
    "check_site_name",
    "file_sha256",
    "load_bundle",
    "read_metadata",
    "save_bundle",
]
