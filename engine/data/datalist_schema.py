"""The datalist specification as a JSON schema, checked every time a datalist is read.

The schema is the machine-readable half of the specification in ``docs/io.md`` ("Datalists"):
top-level ``training`` (required), ``validation`` and ``testing`` lists of ``{"image", "label"}``
entries, and the optional scalar keys ``name``, ``task`` and ``label_convention``. Other top-level
keys are allowed (MONAI/Decathlon files carry ``"labels"``, ``"description"`` ...) and ignored.

:func:`check_datalist_document` turns the first schema violation into a :class:`DataError` that
names the file, the place in it (``training[3].label``) and what is expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from engine.errors import DataError

#: Tasks a datalist may name (``engine.tasks``); kept literal so the schema can be published as is.
TASKS = ("fundus", "prostate")
#: Label conventions a datalist may name (``engine.io.label_conventions.CONVENTIONS``).
LABEL_CONVENTIONS = ("origa", "drishti", "binary", "multilabel")

_ENTRY: dict[str, Any] = {
    "type": "object",
    "required": ["image", "label"],
    "properties": {
        "image": {"type": "string", "minLength": 1, "pattern": r"\S",
                  "description": "image file or DICOM series folder, relative to the datalist's folder"},
        "label": {"type": "string", "minLength": 1, "pattern": r"\S",
                  "description": "mask file (drishti: the *_ODsegSoftmap file), relative to the datalist's folder"},
        "case": {"type": "string", "description": "case id; entries of one case stay in one split"},
    },
}

_SECTION: dict[str, Any] = {"type": "array", "items": {"$ref": "#/$defs/entry"}}

#: JSON schema (draft 2020-12) of a FedSM / MONAI-style datalist.
DATALIST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://fedsm.invalid/schemas/datalist-1.json",
    "title": "FedSM site datalist",
    "type": "object",
    "required": ["training"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9_-]+$",
                 "description": "site name: letters, digits, '-' and '_'"},
        "task": {"enum": list(TASKS)},
        "label_convention": {"enum": list(LABEL_CONVENTIONS)},
        "training": _SECTION,
        "validation": _SECTION,
        "testing": _SECTION,
    },
    "$defs": {"entry": _ENTRY},
}


def _where(error: Any) -> str:
    parts = []
    for item in error.absolute_path:
        parts.append(f"[{item}]" if isinstance(item, int) else (f".{item}" if parts else str(item)))
    return "".join(parts) or "the top level"


def _explain(error: Any) -> str:
    """One sentence for a jsonschema error, in the specification's words."""
    kind = error.validator
    if kind == "required":
        missing = [m for m in error.validator_value if m not in (error.instance or {})]
        if error.absolute_path:
            return (f"has no {' or '.join(map(repr, missing))}; every entry needs an 'image' and a 'label' path")
        return ("has no 'training' section; a datalist needs "
                "'training': [{\"image\": ..., \"label\": ...}, ...]")
    if kind == "enum":
        return (f"is {json.dumps(error.instance)[:60]}; allowed: "
                + ", ".join(json.dumps(v) for v in error.validator_value))
    if kind == "pattern" and error.absolute_path and error.absolute_path[-1] == "name":
        return (f"is {error.instance!r}; a site name uses only letters, digits, '-' and '_' "
                "(no dots or spaces)")
    if kind in ("pattern", "minLength"):
        return f"must be a non-empty path string, got {json.dumps(error.instance)[:60]}"
    if kind == "type":
        expected = error.validator_value
        if expected == "array":
            return f"must be a list of entries, got a JSON {_json_type(error.instance)}"
        if expected == "object" and error.absolute_path:
            return ("must be an object like {\"image\": ..., \"label\": ...}, got "
                    f"{json.dumps(error.instance)[:60]}")
        if expected == "object":
            return f"must be a JSON object with a 'training' list, got a JSON {_json_type(error.instance)}"
        if expected == "string":
            return f"must be a non-empty path string, got {json.dumps(error.instance)[:60]}"
        return f"must be a string, number or boolean, got {json.dumps(error.instance)[:60]}"
    return error.message


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def check_datalist_document(path: str | Path, doc: Any) -> None:
    """Check a parsed datalist against :data:`DATALIST_SCHEMA`.

    Raises
    ------
    DataError
        For the first violation (in document order), naming the file and the place in it, e.g.
        ``site/dl.json: training[2].label must be a non-empty path string, got 3``.
    """
    validator = Draft202012Validator(DATALIST_SCHEMA)
    errors = sorted(validator.iter_errors(doc), key=lambda e: (len(e.absolute_path), list(map(str, e.path))))
    if not errors:
        return
    first = min(errors, key=lambda e: [str(p) for p in e.absolute_path])
    where = _where(first)
    if where == "the top level":
        raise DataError(f"{path}: {_explain(first)}")
    raise DataError(f"{path}: {where} {_explain(first)} (see the datalist specification in docs/io.md)")
