"""Payloads as Flower records: weights as ``ArrayRecord``, settings as ``ConfigRecord``, metrics as ``MetricRecord``.

Instruction (coordinator -> one site; message type ``train``)::

    "fedsm"             ConfigRecord   round, rounds, method, spec (JSON), session, run_id, site, config (JSON)
    "weights:<part>"    ArrayRecord    one per part: global, personal, selector, control, personal/<site>,
                                       style_gate (FedSM's last round: site means and precision)
    "layout"            ConfigRecord   per part: JSON list of [tensor name, dtype, shape]

Reply (site -> coordinator)::

    "fedsm"             ConfigRecord   site, round
    "metrics"           MetricRecord   training metrics (floats) and "num-examples"
    "weights:<part>"    ArrayRecord    global, personal, selector, control_delta, selector_stats, and for
                                       FedSM's site-style gate style_stats (descriptor sums) and style_hist
                                       (last round: a histogram of validation distances); with
                                       site_routing auto, last round: selector_gamma (a confidence
                                       histogram) and routing_stats (two counts)
    "layout"            ConfigRecord   as above

A part's tensors are packed into one flat array per dtype (:func:`pack`; the layout says
where each tensor is), because Flower moves every array as separate objects with one HTTP
request each. Arrays travel as ``.npy`` bytes (Flower's ``numpy.ndarray`` arrays): joined
straight from the tensors' memory into the immutable ``bytes`` Flower's ``Array`` requires,
and read as a view of the received bytes whose header is checked first; no pickle anywhere,
and one copy of the values when sending and one when receiving, instead of three or four
each. A reply is decoded strictly (:func:`decode_update`): unknown records, non-numeric or
foreign-byte-order arrays, layouts that do not add up and non-numeric metrics are refused
before any number is used, and the method's own check (keys, shapes, dtypes, NaN/Inf)
follows on the server.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from numpy.lib import format as npy

from engine.errors import WeightsError
from engine.fl.methods import SiteInstructions, SiteUpdate

INFO = "fedsm"
METRICS = "metrics"
WEIGHTS_PREFIX = "weights:"
LAYOUT = "layout"
NUM_EXAMPLES = "num-examples"
#: dtypes an array may have on the wire (everything a model's state dict holds, and bfloat16:
#: engine.fl.wire_precision).
ALLOWED_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                            "bool"})
#: NumPy has no bfloat16: its values travel as their 16 bits in an int16 ``.npy`` array, declared
#: ``"bfloat16"`` in the record key and the layout.
_STORED_AS = {"bfloat16": "int16"}


def _numpy_values(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    """``(wire dtype name, NumPy view of the tensor's values)``; bfloat16 as its raw 16 bits."""
    values = tensor.detach().cpu().contiguous()
    if values.dtype == torch.bfloat16:
        return "bfloat16", values.view(torch.int16).numpy()
    array = values.numpy()
    return str(array.dtype), array


def pack(weights: dict[str, torch.Tensor]) -> tuple[Any, str]:
    """One part's tensors as an ``ArrayRecord`` of one flat array per dtype, plus its layout (JSON).

    Flower moves every array as its own objects, one HTTP request each; packed, a U-Net is
    two arrays instead of ~60, which cut the transfer time of a FedSM round several-fold.
    """
    groups: dict[str, list[np.ndarray]] = {}
    layout = []
    for key, tensor in weights.items():
        dtype, values = _numpy_values(tensor)
        groups.setdefault(dtype, []).append(values.reshape(-1))
        layout.append([key, dtype, list(values.shape)])
    record = ArrayRecord({dtype: _flat_array(parts) for dtype, parts in groups.items()})
    return record, json.dumps(layout, separators=(",", ":"))


def _flat_array(parts: list[np.ndarray]) -> Any:
    """An ``Array`` holding ``parts`` one after the other, as ``.npy`` bytes (what ``np.save`` writes)."""
    dtype = parts[0].dtype
    total = sum(int(part.size) for part in parts)
    head = io.BytesIO()
    npy.write_array_header_1_0(head, {"descr": npy.dtype_to_descr(dtype), "fortran_order": False,
                                      "shape": (total,)})
    header = head.getvalue()
    # one copy: bytes.join reads the tensors' memory through the buffer protocol
    data = b"".join([header, *(memoryview(np.ascontiguousarray(part)).cast("B") for part in parts)])
    return Array(dtype=str(dtype), shape=(total,), stype="numpy.ndarray", data=data)


def _flat_values(array: Any, dtype: str, what: str) -> np.ndarray:
    """A read-only view of a flat ``.npy`` array's values, after checking its header (:class:`WeightsError`)."""
    data = array.data
    if getattr(array, "stype", None) != "numpy.ndarray" or not isinstance(data, bytes | bytearray | memoryview):
        raise WeightsError(f"{what}: array {dtype!r} is not a NumPy array")
    head = io.BytesIO(bytes(memoryview(data)[:65536 + 16]))
    try:
        version = npy.read_magic(head)
        if version == (1, 0):
            shape, fortran_order, found = npy.read_array_header_1_0(head)
        elif version == (2, 0):
            shape, fortran_order, found = npy.read_array_header_2_0(head)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    except ValueError as exc:
        raise WeightsError(f"{what}: array {dtype!r} is not readable ({exc})") from None
    if str(found) != dtype or found.str[0] == ">" or found.hasobject or len(shape) != 1 or fortran_order:
        raise WeightsError(f"{what}: array {dtype!r} does not match its declared dtype")
    try:
        return np.frombuffer(data, dtype=found, count=shape[0], offset=head.tell())
    except ValueError as exc:
        raise WeightsError(f"{what}: array {dtype!r} is not readable ({exc})") from None


def unpack(record: Any, layout_json: object, what: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack`, checking every declared dtype, shape and size (:class:`WeightsError`)."""
    try:
        layout = json.loads(layout_json) if isinstance(layout_json, str) else None
    except ValueError:
        layout = None
    if not isinstance(layout, list):
        raise WeightsError(f"{what}: missing or unreadable tensor layout")
    flat: dict[str, np.ndarray] = {}
    for dtype, array in record.items():
        stored = _STORED_AS.get(dtype, dtype)
        if dtype not in ALLOWED_DTYPES or array.dtype != stored or len(array.shape) != 1:
            raise WeightsError(f"{what}: array {dtype!r} is not a flat array of a numeric dtype")
        flat[dtype] = _flat_values(array, stored, what)
    offsets = dict.fromkeys(flat, 0)
    out: dict[str, torch.Tensor] = {}
    for entry in layout:
        if (not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str)
                or entry[1] not in flat or not isinstance(entry[2], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])):
            raise WeightsError(f"{what}: malformed layout entry {str(entry)[:80]}")
        key, dtype, shape = entry
        if key in out:
            raise WeightsError(f"{what}: tensor {key} appears twice")
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        start = offsets[dtype]
        if start + size > len(flat[dtype]):
            raise WeightsError(f"{what}: the layout needs more {dtype} values than were sent")
        # the one copy: out of the received (read-only) bytes into the tensor's own memory
        tensor = torch.from_numpy(np.array(flat[dtype][start:start + size], copy=True).reshape(shape))
        out[key] = tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
        offsets[dtype] = start + size
    if any(offsets[d] != len(flat[d]) for d in flat):
        raise WeightsError(f"{what}: more values were sent than the layout describes")
    return out


class PackCache:
    """Packed parts by weight-dict identity: a part every site receives is packed once per round."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple[Any, str, Any]] = {}

    def pack(self, weights: dict[str, torch.Tensor]) -> tuple[Any, str]:
        hit = self._packed.get(id(weights))
        if hit is None or hit[2] is not weights:
            record, layout = pack(weights)
            hit = (record, layout, weights)  # keeps ``weights`` alive, so its id stays unique
            self._packed[id(weights)] = hit
        return hit[0], hit[1]


def weights_records(parts: dict[str, dict[str, torch.Tensor]], cache: PackCache | None = None) -> dict[str, Any]:
    """``{"weights:<part>": ArrayRecord, ..., "layout": ConfigRecord}`` for a payload."""
    out: dict[str, Any] = {}
    layouts: dict[str, str] = {}
    for part, weights in parts.items():
        out[WEIGHTS_PREFIX + part], layouts[part] = cache.pack(weights) if cache is not None else pack(weights)
    out[LAYOUT] = ConfigRecord(layouts)  # type: ignore[arg-type]
    return out


def _weights_from(content: RecordDict, what: str) -> dict[str, dict[str, torch.Tensor]]:
    layouts = content.config_records.get(LAYOUT)
    if layouts is None:
        raise WeightsError(f"{what}: no tensor layout record")
    parts = {}
    for key, record in content.array_records.items():
        if not key.startswith(WEIGHTS_PREFIX):
            raise WeightsError(f"{what}: unexpected array record {key!r}")
        part = key[len(WEIGHTS_PREFIX):]
        parts[part] = unpack(record, layouts.get(part), f"{what}, part {part}")
    if set(layouts) != set(parts):
        raise WeightsError(f"{what}: layouts for {sorted(layouts)} but weights for {sorted(parts)}")
    return parts


def record_contents(content: RecordDict) -> dict[str, int]:
    """Tensors per part in a message (``{"global": 63, ...}``), for progress events."""
    layouts = content.config_records.get(LAYOUT, {})
    out = {}
    for part, text in layouts.items():
        try:
            out[part] = len(json.loads(str(text)))
        except ValueError:
            out[part] = 0
    return out


def record_bytes(content: RecordDict) -> int:
    """Bytes of all arrays in a message (``.npy`` headers included): what the weights cost on the wire."""
    return sum(sum(len(a.data) for a in rec.values()) for rec in content.array_records.values())


@dataclass
class Instruction:
    """A decoded instruction as a site sees it."""

    round: int
    rounds: int
    method: str
    spec_json: str
    session: str
    site: str
    instructions: SiteInstructions
    #: the run id the coordinator signed for this run (engine.security.run_spec)
    run_id: str = ""


def encode_instructions(ins: SiteInstructions, *, rounds: int, method: str, spec_json: str, session: str,
                        site: str, cache: PackCache | None = None, run_id: str = "") -> RecordDict:
    """The content of a ``train`` message for ``site`` (``run_id``: the one the coordinator signed)."""
    info = ConfigRecord({"round": int(ins.round), "rounds": int(rounds), "method": method, "spec": spec_json,
                         "session": session, "run_id": run_id, "site": site,
                         "config": json.dumps(ins.config, sort_keys=True)})
    return RecordDict({INFO: info, **weights_records(ins.weights, cache)})


def decode_instructions(content: RecordDict) -> Instruction:
    """Decode a ``train`` message at the site (raises :class:`WeightsError` when malformed)."""
    info = content.config_records.get(INFO)
    if info is None:
        raise WeightsError("instruction without its 'fedsm' settings record; is the coordinator a FedSM server?")
    try:
        config = json.loads(str(info["config"]))
        weights = _weights_from(content, "instruction")
        rnd = int(info["round"])  # type: ignore[arg-type]
        return Instruction(rnd, int(info["rounds"]), str(info["method"]),  # type: ignore[arg-type]
                           str(info["spec"]), str(info["session"]), str(info["site"]),
                           SiteInstructions(rnd, weights, config), str(info.get("run_id", "")))
    except (KeyError, ValueError, TypeError) as exc:
        raise WeightsError(f"malformed instruction ({exc})") from None


def encode_update(update: SiteUpdate, *, site: str, rnd: int) -> RecordDict:
    """The content of a site's reply: weights, sample count and metrics, nothing else."""
    metrics: dict[str, int | float] = {k: float(v) for k, v in update.metrics.items()}
    metrics[NUM_EXAMPLES] = int(update.num_samples)
    return RecordDict({INFO: ConfigRecord({"site": site, "round": int(rnd)}), METRICS: MetricRecord(metrics),
                       **weights_records(update.weights)})


def decode_update(content: RecordDict, site: str, rnd: int) -> SiteUpdate:
    """Decode a reply from ``site`` for round ``rnd`` strictly (:class:`WeightsError` otherwise)."""
    what = f"reply from {site} (round {rnd})"
    unknown = sorted(k for k in content if k not in (INFO, METRICS, LAYOUT) and not k.startswith(WEIGHTS_PREFIX))
    if unknown:
        raise WeightsError(f"{what} has unexpected records {unknown}")
    info = content.config_records.get(INFO)
    metrics_record = content.metric_records.get(METRICS)
    if info is None or metrics_record is None:
        raise WeightsError(f"{what} lacks its 'fedsm' or 'metrics' record")
    if info.get("site") != site or info.get("round") != rnd:
        raise WeightsError(f"{what} claims to be from site {info.get('site')!r} for round {info.get('round')!r}")
    metrics: dict[str, float] = {}
    for key, value in metrics_record.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise WeightsError(f"{what}: metric {key!r} is not a number")
        metrics[key] = float(value)
    num = metrics.pop(NUM_EXAMPLES, None)
    if num is None or not math.isfinite(num) or num != int(num) or num <= 0:
        raise WeightsError(f"{what}: '{NUM_EXAMPLES}' must be a positive integer, got {num}")
    return SiteUpdate(_weights_from(content, what), int(num), metrics)
