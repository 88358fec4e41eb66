"""JSON schema of a bundle's FedSM metadata, checked before any field is used.

:meth:`engine.bundle.supermodel.BundleMetadata.from_json` parses the metadata text with
:func:`engine.io.guard.load_json` (nesting bounded, so a deeply nested value is a clear error, not a
``RecursionError``) and validates it against :data:`METADATA_SCHEMA` (types and shapes of every
field); the consistency rules (task, sizes, method and routing, ...) are
``BundleMetadata.validate``'s. Unknown fields are reported by ``from_json`` itself (a newer
FedSM may add some), so the schema allows them.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from engine.errors import BundleError

_STRING = {"type": "string"}
_INT = {"type": "integer"}
_NUMBER = {"type": "number"}

#: What every field of the metadata JSON must be (JSON Schema draft 2020-12).
METADATA_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "FedSM super-model bundle metadata",
    "type": "object",
    "required": ["format", "format_version", "task", "label_names", "in_channels", "image_size", "selector_size",
                 "site_names"],
    "properties": {
        "format": _STRING,
        "format_version": _INT,
        "task": _STRING,
        "label_names": {"type": "array", "items": _STRING, "minItems": 1, "maxItems": 255},
        "in_channels": _INT,
        "image_size": _INT,
        "selector_size": _INT,
        "site_names": {"type": "array", "items": _STRING, "minItems": 1, "maxItems": 1000},
        "selector_head": _STRING,
        "selector_width": _INT,
        "normalisation": _STRING,
        "method": _STRING,
        "routing": _STRING,
        "lam": _NUMBER,
        "personalization": _STRING,
        "gamma": _NUMBER,
        "rounds": _INT,
        "val_dice": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
        "created": _STRING,
        "engine_version": _STRING,
        "extra": {"type": "object"},
        "style_gate": {"type": "object"},
        "site_routing": {"enum": ["selector", "style"]},
    },
}


def check_metadata(raw: Any) -> None:
    """Validate parsed metadata against :data:`METADATA_SCHEMA`.

    Raises
    ------
    BundleError
        Naming the first offending field, what it holds and what it should be.
    """
    validator = jsonschema.Draft202012Validator(METADATA_SCHEMA)
    error = jsonschema.exceptions.best_match(validator.iter_errors(raw))
    if error is None:
        return
    where = "/".join(str(p) for p in error.absolute_path) or "the metadata"
    shown = repr(error.instance)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise BundleError(f"its metadata field {where!r} is invalid: {shown} ({error.message[:200]}); the file was "
                      "damaged or not written by FedSM — export the bundle again")
