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

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qiao import envs
from qiao.distributed.parallel_state import tp_rank, tp_size
from qiao.errors import ModelLoadError
from qiao.hal.platform import cpu_has_native_bfloat16
from qiao.kernels import load_or_build
from qiao.layers.linear_method import LinearMethod, _replace_weight, choose_method

if TYPE_CHECKING:
    from qiao.layers.linear import LinearBase

logger = logging.getLogger(__name__)
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
    """float [N, K] -> Int4Weights, asymmetric per group (0 need not be a code): codes rounded
    on the group's [min, max] in 15 steps, then the scale and offset refit to those codes by
    least squares (on stories260K: perplexity 3.48 against plain min/max's 3.54, float32 3.22).
    Rows go `_ROWS_PER_CHUNK` at a time to bound the memory of the temporaries."""
    w = weight.detach().float()
    n, k = w.shape
    g = group_size or int4_group_size(k)
    parts = [_quantize_groups(rows.reshape(-1, k // g, g)) for rows in w.split(_ROWS_PER_CHUNK)]
    codes, scales, offsets = (torch.cat(part) for part in zip(*parts, strict=True))
    return Int4Weights(codes.reshape(n, k), scales, offsets, g)


_ROWS_PER_CHUNK = 1024


def _quantize_groups(groups: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[R, G, g] float32 -> codes uint8 [R, G, g], scales and offsets [R, G] (`quantize_int4`)."""
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    step = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
    scale, base = _refit(codes, groups, step)
    return codes.to(torch.uint8), scale, -base


def _refit(
    codes: torch.Tensor, groups: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale s and base b minimising sum (codes * s + b - w)^2 per group (least squares);
    a group of one code keeps `step` and gets its mean as b."""
    code_mean, mean = codes.mean(dim=2), groups.mean(dim=2)
    centred = codes - code_mean[..., None]
    variance = centred.square().sum(dim=2)
    covariance = (centred * (groups - mean[..., None])).sum(dim=2)
    scale = torch.where(variance > 0, covariance / variance.clamp(min=1e-12), step)
    return scale, mean - scale * code_mean


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

    if isinstance(layer, QKVLinear | MergedLinear) and shard_id is None:
        # A fused checkpoint tensor (Phi-3's qkv_proj, gate_up_proj): its parts in order.
        if isinstance(layer, QKVLinear):
            parts = [(shard, rows) for shard, (_, rows) in layer.shards.items()]
        else:
            parts = list(enumerate(layer.output_sizes))
        _check_rows(w, sum(rows for _, rows in parts) * tp_size(), layer, None)
        start = 0
        for shard, rows in parts:
            attach_int4_weights(layer, w.rows(start, rows * tp_size()), shard)
            start += rows * tp_size()
        return
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


# Rows per matmul up to which `Int4Method` runs the C++ kernel (decode); more rows dequantize
# tiles of the weight and multiply them with ATen (prefill).
INT4_KERNEL_MAX_ROWS = 8
# Output features x input features dequantized per tile of a larger matmul: 1 MiB of float32,
# so a tile is still in cache when its matmul reads it.
_TILE_ELEMENTS = 1 << 18
# Prefill on bfloat16 tiles (`bf16_tiles`); a switch for tests and benchmarks: False keeps the
# float32 tiles everywhere.
PREFILL_BF16 = True
# Elements per bfloat16 tile: 2 MiB. On the Qwen2.5-0.5B shapes (2-core AMD EPYC, 64 and 512
# rows) 2^20 was the fastest or within 8 % of it; 2^17 cost up to 1.8x at 64 rows (oneDNN's
# fixed cost per call on narrow tiles), 2^22 up to 1.2x (docs/results/int4_prefill_bf16.json).
BF16_TILE_ELEMENTS = 1 << 20
_BLOCK = 16  # output features per packed block (the kernel's lanes)
_CHUNK = 8  # input features per 4 bytes of one output feature

_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "csrc" / "int4_ops.cpp"
# -ffp-contract=off: the dequantizations round q * scale and then - offset, as the reference
# does; a product fused into the difference would round once and differ in the last bit.
_CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-fno-math-errno",
    "-ffp-contract=off",
]


@functools.cache
def int4_ops() -> ModuleType | None:
    """The int4 C++ kernels (qiao/kernels/csrc/int4_ops.cpp), or None when disabled
    (QIAO_DISABLE_CPU_KERNELS=1), unbuildable, or without AVX-512 VNNI here."""
    if envs.disable_cpu_kernels():
        return None
    try:
        ops = load_or_build("qiao_int4_ops", _SOURCE, _CFLAGS, ["-fopenmp"])
    except Exception as exc:  # no compiler, headers missing, a timed-out build: say why once
        logger.warning("int4 kernels unavailable, using the PyTorch reference (%s)", exc)
        return None
    return ops if ops.int4_linear_available() else None


@dataclass(frozen=True)
class PackedInt4:
    """Int4Weights in the kernel's layout (int4_ops.cpp): `packed` uint8 [N/16, K/8, 16, 4],
    two codes a byte; `scales` and `offsets` float32 [N/16, K/g, 16]; N padded to 16 with zero
    rows (sliced off)."""

    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    output_size: int


def pack_int4(w: Int4Weights) -> PackedInt4:
    """Byte j of output feature r in chunk c holds q[r, 8c + j] (low nibble) and q[r, 8c + 4 + j]
    (high nibble); the kernel's lanes are 16 consecutive output features."""
    n, k = w.codes.shape
    if k % _CHUNK:
        raise ModelLoadError(f"int4 packing needs input features in multiples of 8, got {k}")
    pad = -n % _BLOCK
    codes = F.pad(w.codes, (0, 0, 0, pad)).reshape(-1, _BLOCK, k // _CHUNK, 2, 4)
    packed = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)  # [NB, 16, K/8, 4]

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G, 16]
        t = F.pad(t.float(), (0, 0, 0, pad))
        return t.reshape(-1, _BLOCK, t.shape[1]).transpose(1, 2).contiguous()

    return PackedInt4(
        packed.transpose(1, 2).contiguous(), lanes(w.scales), lanes(w.offsets), w.group_size, n
    )


def unpack_int4(p: PackedInt4, block0: int = 0, blocks: int | None = None) -> Int4Weights:
    """The inverse of `pack_int4` for output blocks block0..block0+blocks (the kernels' oracle
    and the fallback's dequantization): codes and groups of 16 * blocks output features."""
    blocks = p.packed.shape[0] - block0 if blocks is None else blocks
    packed = p.packed[block0 : block0 + blocks]
    codes = torch.stack([packed & 15, packed >> 4], dim=3)  # [B, K/8, 16, 2, 4]
    codes = codes.permute(0, 2, 1, 3, 4).reshape(blocks * _BLOCK, -1)

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, G, 16] -> [16 B, G]
        return t[block0 : block0 + blocks].transpose(1, 2).reshape(blocks * _BLOCK, -1)

    return Int4Weights(codes, rows(p.scales), rows(p.offsets), p.group_size)


def quantize_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [M, K] rounded per group of `group_size` features to int8 steps d = max |x| / 127
    (round half to even, as the kernel), returned dequantized: what the int4 kernel multiplies."""
    m, k = x.shape
    groups = x.float().reshape(m, k // group_size, group_size)
    step = groups.abs().amax(dim=2, keepdim=True) / 127.0
    codes = torch.round(groups / step.clamp(min=1e-30)).clamp(-127, 127)
    return (codes * step).reshape(m, k)


def int4_linear_reference(
    x: torch.Tensor, w: Int4Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [M, K] x Int4Weights [N, K] -> float32 [M, N]: the decode kernel's oracle. The
    rows rounded per group to int8 steps (`quantize_activations`) times the exact weights."""
    out = F.linear(quantize_activations(x, w.group_size).double(), dequantize_int4(w).double())
    out = out.float()
    return out if bias is None else out + bias.float()


class Int4Method(LinearMethod):
    """Weight-only group-wise int4 (`quantization="int4"`): the layer's attached weights
    (`attach_int4_weights`), else its float weight quantized (`quantize_int4`; input features
    padded with zeros to a multiple of 32 where K is not one), packed for the kernel.

    Few rows (decode) run `int4_linear` (C++, AVX-512 VNNI), which reads each weight byte once:
    half int8's bytes, an eighth of float32's. More rows (prefill) dequantize the weight in
    tiles, so the whole float matrix never exists: on a CPU that multiplies bfloat16 in
    hardware, tiles of 2 MiB of bfloat16 (`int4_dequantize_bf16`, each weight rounded once)
    multiplied by the rows in bfloat16 with float32 sums, as int8's prefill; elsewhere tiles of
    1 MiB of float32 (`int4_dequantize`) multiplied in the input's dtype. Without the kernels
    both steps run in PyTorch (float32 tiles)."""

    name = "int4"

    def __init__(self, batch_hint: int = 64, tile: int | None = None) -> None:
        super().__init__(tile)
        self.batch_hint = batch_hint

    def prepare(self, layer: LinearBase) -> None:
        w = attached_int4_weights(layer)
        layer.__dict__.pop("int4_parts", None)
        if w is None and layer.__dict__.get("int4_keep_dense"):
            # A float layer of a pre-quantized checkpoint (AWQ's and GPTQ's head): as it is.
            layer.method = choose_method(
                layer.weight,
                quantization=None,
                batch_hint=self.batch_hint,
                batch_invariant=self.tile is not None,
            )
            layer.method.prepare(layer)
            return
        if w is None:
            weight = layer.weight.detach()
            w = quantize_int4(F.pad(weight, (0, -weight.shape[1] % FALLBACK_GROUP_SIZE)))
        packed = pack_int4(w)
        layer.register_buffer("weight_scales", packed.scales, persistent=False)
        layer.register_buffer("weight_offsets", packed.offsets, persistent=False)
        layer.int4_group_size = packed.group_size
        layer.int4_input_size = w.codes.shape[1]  # K, padded to the groups
        _replace_weight(layer, packed.packed)

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        # Past the kernel's rows, a bfloat16 matmul (oneDNN) on the CPU: bfloat16 tiles, or
        # float32 tiles by bfloat16 rows.
        if self.tile is not None or layer.weight.device.type != "cpu":
            return None
        if dtype == torch.bfloat16 or (int4_ops() is not None and bf16_tiles()):
            return INT4_KERNEL_MAX_ROWS + 1
        return None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if layer.int4_input_size != rows.shape[1]:
            rows = F.pad(rows, (0, layer.int4_input_size - rows.shape[1]))
        ops = int4_ops() if rows.device.type == "cpu" else None
        if ops is not None and rows.shape[0] <= INT4_KERNEL_MAX_ROWS and self.tile is None:
            bias = layer.bias.float() if layer.bias is not None else _EMPTY
            out = ops.int4_linear(
                rows.float().contiguous(),
                layer.weight,
                layer.weight_scales,
                layer.weight_offsets,
                layer.int4_group_size,
                layer.output_size,
                bias,
            )
        else:
            out = self._dequantized_matmul(layer, rows, ops)
        return out.to(x.dtype).reshape(*shape[:-1], layer.output_size)

    def _dequantized_matmul(
        self, layer: LinearBase, rows: torch.Tensor, ops: ModuleType | None
    ) -> torch.Tensor:
        """rows [M, K] x the weight, one tile of output features at a time, so the whole float
        matrix never exists: each tile is dequantized to W^T [K, n] and multiplied by ATen.
        With the kernels on a CPU that multiplies bfloat16 in hardware (`bf16_tiles`) the tile
        is bfloat16 (each weight rounded once from its float32 value) and rows are rounded to
        bfloat16 (int8's prefill numerics, float32 sums); else it is float32 (the C++ kernel,
        else `unpack_int4`) multiplied in rows' dtype."""
        n, k = layer.output_size, layer.int4_input_size
        p = PackedInt4(
            layer.weight, layer.weight_scales, layer.weight_offsets, layer.int4_group_size, n
        )
        bf16 = ops is not None and bf16_tiles()
        dtype = torch.bfloat16 if bf16 else rows.dtype
        # Each tile's product lands converted in the caller's dtype: one pass over the output.
        out = torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
        rows = rows.to(dtype)
        blocks = p.packed.shape[0]
        step = max(4, (BF16_TILE_ELEMENTS if bf16 else _TILE_ELEMENTS) // (k * _BLOCK))
        buffer = torch.empty(k * _BLOCK * min(step, blocks), dtype=dtype) if bf16 else None
        for b in range(0, blocks, step):
            size = min(step, blocks - b)
            args = (p.packed, p.scales, p.offsets, p.group_size, n, k, b, size)
            if buffer is not None:  # one buffer for every tile: its pages are touched once
                tile = buffer[: k * _BLOCK * size].view(k, _BLOCK * size)
                ops.int4_dequantize_bf16(*args, tile)
            elif ops is not None:
                tile = ops.int4_dequantize(*args)
            else:
                tile = dequantize_int4(unpack_int4(p, b, size)).t()
            n0, n1 = b * _BLOCK, min(n, (b + size) * _BLOCK)
            tile = tile[:, : n1 - n0].to(dtype)
            out[:, n0:n1] = self.rows_matmul(lambda r, t=tile: r @ t, rows)
        return out if layer.bias is None else out.add_(layer.bias)


def bf16_tiles() -> bool:
    """Whether prefill multiplies bfloat16 tiles (`PREFILL_BF16` and a CPU that multiplies
    bfloat16 in hardware: AMX or AVX-512 BF16, about 2x its float32 rate)."""
    return PREFILL_BF16 and cpu_has_native_bfloat16()


_EMPTY = torch.empty(0)
