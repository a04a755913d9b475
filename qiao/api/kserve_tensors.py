"""KServe v2 tensors, shared by the HTTP (`kserve.py`) and gRPC (`kserve_grpc.py`) transports.

Owns the datatype ↔ numpy mapping, decoding request tensors (JSON/typed values or raw
little-endian bytes, BYTES as 4-byte little-endian length + bytes), checking them against a served
version's `TensorSpec`s, encoding outputs, the request parameters both transports accept, and the
two model lookups whose meaning both must share (which version metadata describes; readiness).

Every problem with a request is a `ConfigError` whose message names the input or output (the
transports answer 400 / INVALID_ARGUMENT). A tensor's data is checked against its shape before
anything is allocated, and `MAX_NUM_ELEMENTS` / `MAX_NUM_BYTES_ELEMENTS` bound what one request
may decode to, whatever the body or message size limit.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qiao.errors import ConfigError, EngineUnavailableError
from qiao.repository.types import DATATYPES, ModelRouter, ServedVersion, TensorSpec

SERVER_NAME = "qiao"
# Protocol extensions both transports implement. The repository extension's load and unload
# live on the management listener (the inference listeners serve only its index), so they do
# not announce it.
EXTENSIONS = (
    "binary_tensor_data",
    "parameters",
    "schedule_policy",
    "model_configuration",
    "statistics",
)

# Elements one request may decode to, over all its inputs (FP64: 128 MiB). BYTES elements cost
# a Python object each, so they have their own, lower bound.
MAX_NUM_ELEMENTS = 1 << 24
MAX_NUM_BYTES_ELEMENTS = 1 << 20
MAX_NUM_DIMS = 16

_DATATYPE_OF: dict[np.dtype, str] = {dtype: name for name, dtype in DATATYPES.items()}
# Which decoded-value kinds (numpy dtype.kind) each datatype accepts: JSON numbers arrive as
# int64/float64/bool arrays; integers may feed float tensors, never the reverse.
_ACCEPTED_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class TensorHeader:
    """What a request says about one input before its data is read."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class InferOptions:
    """Request parameters that reach the served version or the router."""

    priority: int | None = None  # 1 = highest level; None = the model's default
    timeout_us: int | None = None  # None = the model's default queue timeout
    user: str | None = None  # sticky key for the traffic split between versions


def metadata_version(
    model_router: ModelRouter, model: str, version: str | None
) -> tuple[ServedVersion, list[str]]:
    """The version metadata describes (the pinned one, else the latest ready one) and the ready
    versions. Raises as `ModelRouter.get` does for an unknown or unready model."""
    versions = model_router.ready_versions(model)
    if version is None and versions:
        version = versions[-1]
    return model_router.get(model, version), versions


def is_model_ready(model_router: ModelRouter, model: str, version: str | None) -> bool:
    """Whether `model` (or that version of it) takes requests now; raises `ModelNotFoundError`
    for an unknown model or version."""
    try:
        model_router.get(model, version)
    except EngineUnavailableError:
        return False
    return True


def parse_header(name: Any, datatype: Any, shape: Any) -> TensorHeader:
    """Check an input's name, datatype and shape (non-negative integer dims)."""
    if not isinstance(name, str) or not name:
        raise ConfigError("every input needs a non-empty 'name'")
    if datatype not in DATATYPES:
        raise ConfigError(
            f"input {name!r}: datatype {datatype!r} is not one of {', '.join(DATATYPES)}"
        )
    if not isinstance(shape, Sequence) or isinstance(shape, str | bytes):
        raise ConfigError(f"input {name!r}: 'shape' must be a list of integers")
    if len(shape) > MAX_NUM_DIMS:
        raise ConfigError(f"input {name!r}: shape has {len(shape)} dims; at most {MAX_NUM_DIMS}")
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 0:
            raise ConfigError(f"input {name!r}: shape {list(shape)} must hold integers >= 0")
    header = TensorHeader(name, datatype, tuple(int(d) for d in shape))
    if header.num_elements > MAX_NUM_ELEMENTS:
        raise ConfigError(
            f"input {name!r}: shape {list(shape)} holds {header.num_elements} elements; "
            f"the limit is {MAX_NUM_ELEMENTS}"
        )
    return header


def check_inputs(served: ServedVersion, headers: Sequence[TensorHeader]) -> None:
    """Names, datatypes and shapes against the version's specs (-1 in a spec = any size).

    Which inputs are required is the served version's to say: it raises for a missing one."""
    specs = {spec.name: spec for spec in served.inputs}
    seen: set[str] = set()
    num_elements = num_bytes_elements = 0
    for header in headers:
        if header.name in seen:
            raise ConfigError(f"input {header.name!r} is given twice")
        seen.add(header.name)
        spec = specs.get(header.name)
        if spec is None:
            raise ConfigError(
                f"model {served.model!r} has no input {header.name!r}; "
                f"its inputs are {sorted(specs)}"
            )
        if header.datatype != spec.datatype:
            raise ConfigError(f"input {header.name!r} is {spec.datatype}, not {header.datatype}")
        if not _fits(header.shape, spec.shape) and not (
            spec.reshape is not None and _fits(header.shape, spec.reshape)
        ):
            takes = (
                list(spec.shape)
                if spec.reshape is None
                else f"{list(spec.shape)} or {list(spec.reshape)}"
            )
            raise ConfigError(
                f"input {header.name!r} has shape {list(header.shape)}; "
                f"model {served.model!r} takes {takes} (-1 = any size)"
            )
        num_elements += header.num_elements
        if header.datatype == "BYTES":
            num_bytes_elements += header.num_elements
    if num_elements > MAX_NUM_ELEMENTS:
        raise ConfigError(
            f"the inputs hold {num_elements} elements; the limit is {MAX_NUM_ELEMENTS}"
        )
    if num_bytes_elements > MAX_NUM_BYTES_ELEMENTS:
        raise ConfigError(
            f"the BYTES inputs hold {num_bytes_elements} elements; "
            f"the limit is {MAX_NUM_BYTES_ELEMENTS}"
        )


def _fits(shape: tuple[int, ...], spec_shape: tuple[int, ...]) -> bool:
    if len(shape) != len(spec_shape):
        return False
    return all(want in (-1, dim) for dim, want in zip(shape, spec_shape, strict=True))


def check_outputs(served: ServedVersion, names: Iterable[str]) -> list[str]:
    """The requested output names, checked against the version's outputs (duplicates dropped)."""
    known = [spec.name for spec in served.outputs]
    requested = list(dict.fromkeys(names))
    for name in requested:
        if name not in known:
            raise ConfigError(
                f"model {served.model!r} has no output {name!r}; its outputs are {known}"
            )
    return requested


def select_outputs(
    served: ServedVersion, results: Mapping[str, np.ndarray], requested: Sequence[str]
) -> list[tuple[str, np.ndarray]]:
    """The outputs to send, in the requested order (all, in the version's order, if none)."""
    if requested:
        names = list(requested)
    else:
        order = {spec.name: i for i, spec in enumerate(served.outputs)}
        names = sorted(results, key=lambda name: order.get(name, len(order)))
    missing = [name for name in names if name not in results]
    if missing:
        raise RuntimeError(f"model {served.model!r} returned no output {missing[0]!r}")
    return [(name, np.asarray(results[name])) for name in names]


def parse_options(parameters: Mapping[str, Any]) -> InferOptions:
    """`priority` and `timeout` (µs; 0 = the model's default) and `user` from request parameters.

    Sequence batching is not served, so a request naming a sequence is refused."""
    if parameters.get("sequence_id") not in (None, 0, ""):
        raise ConfigError("parameters.sequence_id: sequence batching is not supported")
    priority = _non_negative_int(parameters, "priority")
    timeout_us = _non_negative_int(parameters, "timeout")
    user = parameters.get("user")
    if user is not None and not isinstance(user, str):
        raise ConfigError("parameters.user must be a string")
    return InferOptions(priority=priority or None, timeout_us=timeout_us or None, user=user)


def _non_negative_int(parameters: Mapping[str, Any], key: str) -> int | None:
    value = parameters.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"parameters.{key} must be an integer >= 0")
    return value


# --- decoding -----------------------------------------------------------------------------------


def from_json(header: TensorHeader, data: Any) -> np.ndarray:
    """An input from JSON `data`: a flat or nested (row-major) list; BYTES elements are strings."""
    if not isinstance(data, list):
        raise ConfigError(f"input {header.name!r}: 'data' must be a list")
    if header.datatype == "BYTES":
        return bytes_from_items(header, _flatten(header, data))
    try:
        values = np.asarray(data)
    except (ValueError, TypeError):  # ragged nesting
        raise ConfigError(
            f"input {header.name!r}: 'data' must be a flat or evenly nested list of numbers"
        ) from None
    return from_array(header, values)


def from_array(header: TensorHeader, values: np.ndarray) -> np.ndarray:
    """Cast decoded `values` to the header's datatype, refusing lossy casts; reshape.

    E.g. JSON [1, 2] feeds INT8 or FP32; [1.5] does not feed INT64; [300] does not feed UINT8."""
    dtype = DATATYPES[header.datatype]
    if values.size != header.num_elements:
        raise _count_error(header, values.size)
    if values.size and values.dtype.kind not in _ACCEPTED_KINDS[dtype.kind]:
        raise ConfigError(
            f"input {header.name!r}: {header.datatype} data must hold {_KIND_WORDS[dtype.kind]}"
        )
    if values.size and dtype.kind in "iu" and values.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = int(values.min()), int(values.max())
        if low < info.min or high > info.max:
            raise ConfigError(
                f"input {header.name!r}: values {low}..{high} do not fit {header.datatype}"
            )
    with np.errstate(over="ignore"):  # a float too large for FP16/FP32 becomes inf, as in C
        return values.astype(dtype).reshape(header.shape)


def from_raw(header: TensorHeader, raw: bytes) -> np.ndarray:
    """An input from little-endian element bytes (BYTES: 4-byte length + bytes per element)."""
    if header.datatype == "BYTES":
        return bytes_from_items(header, _split_bytes(header, raw))
    dtype = DATATYPES[header.datatype]
    expected = header.num_elements * dtype.itemsize
    if len(raw) != expected:
        raise ConfigError(
            f"input {header.name!r}: shape {list(header.shape)} of {header.datatype} takes "
            f"{expected} bytes, but {len(raw)} were sent"
        )
    if header.datatype == "BOOL":
        values = np.frombuffer(raw, dtype=np.uint8) != 0
    else:
        values = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)
    return values.reshape(header.shape)


def bytes_from_items(header: TensorHeader, items: Sequence[Any]) -> np.ndarray:
    """A BYTES input (numpy object array of `bytes`) from str or bytes elements."""
    if len(items) != header.num_elements:
        raise _count_error(header, len(items))
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        if isinstance(item, str):
            array[i] = item.encode("utf-8")
        elif isinstance(item, bytes | bytearray):
            array[i] = bytes(item)
        else:
            raise ConfigError(f"input {header.name!r}: BYTES data must hold strings")
    return array.reshape(header.shape)


def _flatten(header: TensorHeader, data: list[Any]) -> list[Any]:
    """Row-major leaves of nested lists, without recursion (nesting depth is the client's)."""
    leaves: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) > MAX_NUM_DIMS:
                    raise ConfigError(f"input {header.name!r}: 'data' is nested too deeply")
                stack.append(iter(item))
                break
            leaves.append(item)
            if len(leaves) > header.num_elements:
                raise _count_error(header, f"more than {header.num_elements}")
        else:
            stack.pop()
    return leaves


def _split_bytes(header: TensorHeader, raw: bytes) -> list[bytes]:
    items: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if len(items) == header.num_elements:
            raise _count_error(header, f"more than {header.num_elements}")
        if offset + _LENGTH.size > len(raw):
            raise ConfigError(f"input {header.name!r}: BYTES data ends inside a length prefix")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise ConfigError(
                f"input {header.name!r}: a BYTES element of {length} bytes runs past the data"
            )
        items.append(raw[offset : offset + length])
        offset += length
    return items


def _count_error(header: TensorHeader, count: int | str) -> ConfigError:
    return ConfigError(
        f"input {header.name!r}: shape {list(header.shape)} holds {header.num_elements} "
        f"elements, but the data has {count}"
    )


# --- encoding -----------------------------------------------------------------------------------


def datatype_of(name: str, array: np.ndarray) -> str:
    """The KServe datatype of an output array (str/bytes arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    datatype = _DATATYPE_OF.get(array.dtype.newbyteorder("="))
    if datatype is None:
        raise TypeError(f"output {name!r} has dtype {array.dtype}, which KServe cannot carry")
    return datatype


def to_raw(name: str, array: np.ndarray) -> bytes:
    """Little-endian element bytes in row-major order (BYTES: length-prefixed elements)."""
    if datatype_of(name, array) == "BYTES":
        return b"".join(_LENGTH.pack(len(item)) + item for item in _bytes_items(name, array))
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def to_json(name: str, array: np.ndarray) -> list[Any]:
    """Row-major JSON values (BYTES as UTF-8 strings)."""
    if datatype_of(name, array) != "BYTES":
        return array.reshape(-1).tolist()
    try:
        return [item.decode("utf-8") for item in _bytes_items(name, array)]
    except UnicodeDecodeError:
        raise ConfigError(
            f"output {name!r} holds bytes that are not UTF-8; request it with binary data"
        ) from None


def _bytes_items(name: str, array: np.ndarray) -> list[bytes]:
    items = []
    for item in array.reshape(-1).tolist():
        if isinstance(item, str):
            item = item.encode("utf-8")
        if not isinstance(item, bytes | bytearray):
            raise TypeError(f"output {name!r} holds a {type(item).__name__}, not bytes")
        items.append(bytes(item))
    return items


def spec_json(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}
