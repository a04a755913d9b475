"""Group-wise 4-bit weights: the shared form every int4 source is turned into.

`Int4Weights` is one matrix W [N, K] as codes q in 0..15 with a scale s and an offset o per
group of `group_size` consecutive input features of each row: W[n, k] = q[n, k] * s[n, g] -
o[n, g], g = k // group_size. Every int4 source maps onto it:

- `--quantization int4` on a float checkpoint (`quantize_int4`): asymmetric min/max per group,
  s = (max - min) / 15, o = -min (q = round((w - min) / s)).
- AWQ and GPTQ checkpoints: w = (q - z) * s, so o = z * s.
- GGUF Q4_0: w = (q - 8) * d (o = 8 d); Q4_K: w = q * (d sc) - dmin m (o = dmin m).

A loader hands each layer its weights with `attach_int4_weights` (whole-checkpoint tensors, like
`weight_loader`); the layer's int4 method then packs them as they are, without requantizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qiao.distributed.parallel_state import tp_rank, tp_size
from qiao.errors import ModelLoadError

if TYPE_CHECKING:
    from qiao.layers.linear import LinearBase

# Group size of `quantize_int4` where K allows it, else FALLBACK_GROUP_SIZE.
DEFAULT_GROUP_SIZE = 128
FALLBACK_GROUP_SIZE = 32


@dataclass(frozen=True)
class Int4Weights:
    """W [N, K] = codes * scales - offsets, per group of `group_size` input features."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15 (unpacked, one code per element)
    scales: torch.Tensor  # float32 [N, K // group_size]
    offsets: torch.Tensor  # float32 [N, K // group_size]; weight = codes * scale - offset
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.group_size <= 0 or k % self.group_size:
            raise ModelLoadError(
                f"int4 weights of {k} input features in groups of {self.group_size}: the group "
                "size must divide the input features"
            )
        groups = (n, k // self.group_size)
        for name in ("scales", "offsets"):
            if tuple(getattr(self, name).shape) != groups:
                raise ModelLoadError(
                    f"int4 {name} of shape {tuple(getattr(self, name).shape)}, {groups} expected "
                    f"for codes {tuple(self.codes.shape)} in groups of {self.group_size}"
                )

    def rows(self, start: int, size: int) -> Int4Weights:
        """Output features start..start+size (a column-parallel rank's slice, a fused part)."""
        return Int4Weights(
            self.codes.narrow(0, start, size),
            self.scales.narrow(0, start, size),
            self.offsets.narrow(0, start, size),
            self.group_size,
        )

    def columns(self, start: int, size: int) -> Int4Weights:
        """Input features start..start+size, whole groups only (a row-parallel rank's slice)."""
        g = self.group_size
        if start % g or size % g:
            raise ModelLoadError(
                f"int4 weights in groups of {g} cannot be split at input feature {start} into "
                f"{size} per rank: the input features per rank must be a multiple of the group "
                "size (use fewer tensor-parallel ranks)"
            )
        return Int4Weights(
            self.codes.narrow(1, start, size),
            self.scales.narrow(1, start // g, size // g),
            self.offsets.narrow(1, start // g, size // g),
            g,
        )


def dequantize_int4(w: Int4Weights) -> torch.Tensor:
    """float32 [N, K]: codes * scale - offset of each group; the reference of every int4 path."""
    n, k = w.codes.shape
    groups = w.codes.float().reshape(n, k // w.group_size, w.group_size)
    weight = groups * w.scales.float()[..., None] - w.offsets.float()[..., None]
    return weight.reshape(n, k)


def int4_group_size(input_size: int) -> int:
    """The group size `quantize_int4` uses for K = `input_size`: 128, or 32 when 128 does not
    divide K, or K itself (one group per row) when neither does."""
    for g in (DEFAULT_GROUP_SIZE, FALLBACK_GROUP_SIZE):
        if input_size % g == 0:
            return g
    return input_size


def quantize_int4(weight: torch.Tensor, group_size: int | None = None) -> Int4Weights:
    """float [N, K] -> Int4Weights, asymmetric per group: the group's min maps to code 0 and its
    max to 15 (s = (max - min) / 15, o = -min), so 0 need not be representable exactly."""
    w = weight.detach().float()
    n, k = w.shape
    g = group_size or int4_group_size(k)
    groups = w.reshape(n, k // g, g)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scales = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
    return Int4Weights(codes.to(torch.uint8).reshape(n, k), scales, -low, g)


def attach_int4_weights(
    layer: LinearBase, w: Int4Weights, shard_id: str | int | None = None
) -> None:
    """Hand `layer` pre-quantized weights of one whole checkpoint tensor, as `weight_loader`
    takes its float tensor: this rank's slice is kept (output rows of a column-parallel layer,
    whole groups of input features of a row-parallel one), a fused layer's part by `shard_id`
    (qkv: "q"/"k"/"v", merged: 0, 1, ...). The layer's int4 method stacks the parts along N and
    packs them as they are in `prepare` (no requantization)."""
    from qiao.layers.linear import (
        ColumnParallelLinear,
        MergedLinear,
        QKVLinear,
        RowParallelLinear,
    )

    if isinstance(layer, QKVLinear | MergedLinear):
        if isinstance(layer, QKVLinear):
            if shard_id not in layer.shards:
                raise ModelLoadError(f"int4 shard id {shard_id!r} of qkv; expected q, k or v")
            size = layer.shards[shard_id][1]
        else:
            if not isinstance(shard_id, int) or not 0 <= shard_id < len(layer.output_sizes):
                raise ModelLoadError(
                    f"int4 shard id {shard_id!r} of a {len(layer.output_sizes)}-way merge"
                )
            size = layer.output_sizes[shard_id]
        _check_rows(w, size * tp_size(), layer, shard_id)
        part = w.rows(tp_rank() * size, size)
    elif shard_id is not None:
        raise ModelLoadError(f"int4 weights given shard id {shard_id!r} for an unfused layer")
    elif isinstance(layer, RowParallelLinear):
        _check_rows(w, layer.output_size, layer, None)
        if w.codes.shape[1] != layer.input_size * tp_size():
            raise ModelLoadError(
                f"int4 weights of {w.codes.shape[1]} input features, "
                f"{layer.input_size * tp_size()} expected"
            )
        part = w.columns(tp_rank() * layer.input_size, layer.input_size)
    else:
        rows = layer.output_size
        whole = rows * tp_size() if isinstance(layer, ColumnParallelLinear) else rows
        _check_rows(w, whole, layer, None)
        part = w.rows(tp_rank() * rows, rows) if whole != rows else w
    if part.codes.shape[1] != layer.input_size:
        raise ModelLoadError(
            f"int4 weights of {part.codes.shape[1]} input features, {layer.input_size} expected"
        )
    parts: dict = layer.__dict__.setdefault("int4_parts", {})
    parts[shard_id] = part


def _check_rows(w: Int4Weights, rows: int, layer: LinearBase, shard_id: str | int | None) -> None:
    if w.codes.shape[0] != rows:
        part = "" if shard_id is None else f" (part {shard_id!r})"
        raise ModelLoadError(
            f"int4 weights of {w.codes.shape[0]} output features for a "
            f"{type(layer).__name__}{part} of {rows}"
        )


def attached_int4_weights(layer: LinearBase) -> Int4Weights | None:
    """The weights attached to `layer`, its parts stacked along N in the layer's order (qkv:
    q, k, v; merged: 0, 1, ...), or None when none were attached."""
    parts: dict | None = layer.__dict__.get("int4_parts")
    if not parts:
        return None
    from qiao.layers.linear import MergedLinear, QKVLinear

    if isinstance(layer, QKVLinear):
        order: list = list(layer.shards)
    elif isinstance(layer, MergedLinear):
        order = list(range(len(layer.output_sizes)))
    else:
        order = [None]
    missing = [shard for shard in order if shard not in parts]
    if missing:
        raise ModelLoadError(
            f"int4 weights of {type(layer).__name__} lack part(s) {', '.join(map(str, missing))}"
        )
    chosen = [parts[shard] for shard in order]
    sizes = {p.group_size for p in chosen}
    if len(sizes) > 1:
        raise ModelLoadError(f"int4 parts of one layer in different group sizes {sorted(sizes)}")
    return Int4Weights(
        torch.cat([p.codes for p in chosen]),
        torch.cat([p.scales.float() for p in chosen]),
        torch.cat([p.offsets.float() for p in chosen]),
        chosen[0].group_size,
    )
