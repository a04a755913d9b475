"""What the API layer sees of the model platform: served versions and the router.

The KServe v2 routes (HTTP and gRPC), the OpenAI routes and the management API are written
against these protocols only, so each can be tested with a small fake.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from qiao.repository.statistics import InferStatistics

# KServe v2 tensor datatypes and their numpy dtypes (BYTES tensors are numpy object arrays of
# `bytes`).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a served model. `shape` counts the batch dimension; -1 = any.

    `reshape`, as in Triton's model configuration, is the shape (batch dimension included) the
    model sees when it differs from `shape`: one text per row is shape [-1, 1] (Triton has no
    empty dims) reshaped to [-1]. A request may send either shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    reshape: tuple[int, ...] | None = None


def _latest_one() -> Mapping[str, Any]:
    return {"latest": {"num_versions": 1}}


@dataclass(frozen=True)
class Batching:
    """How a served version batches, in Triton's model-configuration terms."""

    # 0: the model takes no batch dimension (its TensorSpec shapes are the whole tensors); else
    # the most rows one batch holds (the first axis of every TensorSpec is the batch).
    max_batch_size: int = 0
    # Triton's `dynamic_batching` (None: requests are not batched together by a queue).
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int | None = None
    # The model's `version_policy` as Triton writes it, e.g. {"specific": {"versions": [1, 3]}}.
    version_policy: Mapping[str, Any] = field(default_factory=_latest_one)


class VersionState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    UNAVAILABLE = "unavailable"


class ServedVersion(Protocol):
    """One loaded version of one model, ready to take requests."""

    model: str
    version: str
    backend: str  # "llm" | "embedding" | "onnx"
    platform: str  # KServe metadata platform, e.g. "pytorch_libtorch", "onnxruntime_onnx"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: Batching
    statistics: InferStatistics  # Triton's statistics extension, recorded by the version

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        *,
        priority: int | None = None,
        timeout_us: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one request (its rows are the first axis of every input); returns its outputs.

        Raises `ConfigError` for bad inputs (400), `QueueFullError` / `QueueTimeoutError` (503),
        `EngineUnavailableError` when the version is going away (503)."""
        ...


@dataclass(frozen=True)
class VersionStatus:
    """A row of the repository index."""

    model: str
    version: str
    state: VersionState
    reason: str = ""
    circuit_breaker: str | None = None  # an LLM version's breaker: closed, open, half-open


class ModelRouter(Protocol):
    """Model name (and optional version) → the served version that takes the request."""

    def is_ready(self) -> bool:
        """Every model that should be serving has a ready version."""
        ...

    def model_names(self) -> list[str]:
        """Models with at least one ready version, sorted."""
        ...

    def get(
        self, model: str, version: str | None = None, *, user: str | None = None
    ) -> ServedVersion:
        """The version to serve: the pinned one, else a pick by traffic weights (sticky per
        `user`). Raises `ModelNotFoundError` (404) for an unknown model or version, and
        `EngineUnavailableError` (503) for a known one that is not ready."""
        ...

    def ready_versions(self, model: str) -> list[str]:
        """Ready versions of `model`, ascending; [] when unknown."""
        ...


class ModelControl(Protocol):
    """The repository side of the management API and of KServe's repository extension."""

    def index(self) -> list[VersionStatus]: ...

    async def load(self, model: str) -> None:
        """(Re)load `model` from the repository: new versions become ready before they get
        traffic; a version that fails is reported UNAVAILABLE and the old ones keep serving.
        Raises `ModelNotFoundError` for a name not in the repository, `ConfigError` for a bad
        name or config."""
        ...

    async def unload(self, model: str) -> None:
        """Stop routing to `model`, let in-flight requests finish, free it."""
        ...

    def set_traffic(self, model: str, weights: dict[str, float]) -> None:
        """Per-version traffic weights (versions must be loaded; weights >= 0, sum > 0)."""
        ...
