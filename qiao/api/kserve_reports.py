"""Triton's model configuration and statistics, built once for both KServe transports.

Each builder returns Triton's JSON shape (the HTTP body as tritonclient.http returns it); the gRPC
service parses the same dict into its messages, whose field names are Triton's
(`json_format.ParseDict`), so the two transports cannot drift apart.

- `model_config`: name, platform, backend, max_batch_size, input / output (data_type as
  "TYPE_FP32", dims without the batch dimension when max_batch_size > 0, so [batch] + dims is
  the shape `infer` takes; one text per row is dims [1] with Triton's reshape {shape: []}, and
  `infer` takes [batch] too), dynamic_batching when a queue batches
  the version, version_policy.
- `model_statistics`: the versions' `InferStatistics` as Triton's statistics extension reports
  them: one version, every ready version of a model, or of every model.

The repository index both transports answer is the management listener's own
(`management.v2_index_rows`).
"""

from __future__ import annotations

from typing import Any

from qiao.api.kserve_tensors import metadata_version
from qiao.repository.statistics import Duration, InferStatistics
from qiao.repository.types import ModelRouter, ServedVersion, TensorSpec


def triton_datatype(datatype: str) -> str:
    """KServe's datatype name → Triton's model-configuration enum name (BYTES is TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(model_router: ModelRouter, model: str, version: str | None) -> dict[str, Any]:
    """The configuration of `model` (that version, else its latest ready one)."""
    served, _ = metadata_version(model_router, model, version)
    batching = served.batching
    config: dict[str, Any] = {
        "name": served.model,
        "platform": served.platform,
        "backend": served.backend,
        "version_policy": dict(batching.version_policy),
        "max_batch_size": batching.max_batch_size,
        "input": [_tensor(spec, batching.max_batch_size) for spec in served.inputs],
        "output": [_tensor(spec, batching.max_batch_size) for spec in served.outputs],
    }
    if batching.max_queue_delay_us is not None:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": batching.max_queue_delay_us,
        }
    return config


def _tensor(spec: TensorSpec, max_batch_size: int) -> dict[str, Any]:
    def unbatched(shape: tuple[int, ...]) -> list[int]:
        return list(shape[1:] if max_batch_size > 0 else shape)

    tensor: dict[str, Any] = {
        "name": spec.name,
        "data_type": triton_datatype(spec.datatype),
        "dims": unbatched(spec.shape),
    }
    if spec.reshape is not None:
        tensor["reshape"] = {"shape": unbatched(spec.reshape)}
    return tensor


def model_statistics(
    model_router: ModelRouter, model: str | None, version: str | None
) -> dict[str, Any]:
    """`{"model_stats": [...]}` of one version, of every ready version of `model`, or (no model)
    of every model. Raises as `ModelRouter.get` does for an unknown or unready model."""
    if model is None:
        served = [
            model_router.get(name, v)
            for name in model_router.model_names()
            for v in model_router.ready_versions(name)
        ]
    elif version is not None:
        served = [model_router.get(model, version)]
    else:
        versions = model_router.ready_versions(model)
        served = [model_router.get(model, v) for v in versions] or [model_router.get(model)]
    return {"model_stats": [_version_stats(s) for s in served]}


def _version_stats(served: ServedVersion) -> dict[str, Any]:
    stats: InferStatistics = served.statistics
    return {
        "name": served.model,
        "version": served.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {
            "success": _duration(stats.success),
            "fail": _duration(stats.fail),
            "queue": _duration(stats.queue),
            "compute_input": _duration(stats.compute_input),
            "compute_infer": _duration(stats.compute_infer),
            "compute_output": _duration(stats.compute_output),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(batch.compute_input),
                "compute_infer": _duration(batch.compute_infer),
                "compute_output": _duration(batch.compute_output),
            }
            for size, batch in sorted(stats.batches.items())
        ],
    }


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}
