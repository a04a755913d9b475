"""How a linear layer stores its weight and multiplies by it, chosen once after loading.

- `DenseMethod`: `F.linear` on the checkpoint's tensor; the reference, used wherever nothing
  faster applies (CUDA, float16, no oneDNN).
- `PackedF32Method`: on an AVX-512 CPU in float32, qiao's C++ kernel (`linear_f32`) over the
  weight packed once in 32-feature column blocks (`pack_linear_f32`). Each weight vector is
  loaded once per tile of up to 8 rows, so few rows (decode) stream the weight at close to memory
  bandwidth. On the 135M shape's 30 layers + head (2 cores, same run): 1 row 18.5 ms against
  oneDNN's 40.1, 16 rows 33.6 against 42.0, 80 rows 117.6 against 142.5, 256 rows even.
  Float32 accumulation, as `F.linear` (its test oracle); sums in another order, so results
  differ from it by float32 rounding only.
- `OneDnnMethod`: on the CPU in float32 / bfloat16 the weight is reordered once into oneDNN's
  blocked layout for the expected rows per matmul (`batch_hint`). The same math as `F.linear`
  (float32 accumulation), 1.3-1.7x faster at decode shapes than MKL on the plain tensor, because
  the weight is no longer re-packed on every call. Float32 without the AVX-512 kernel, and
  bfloat16, use it; bfloat16 only where the CPU has oneDNN's bfloat16 path (AVX-512 BW/VL/DQ or
  AVX-NE-CONVERT: an AVX2-only CPU refuses the prepack, and bfloat16 stays on `F.linear`).
- `Int8Method` (`quantization="int8"`): weight-only int8, symmetric per output channel
  (scale = max |w| / 127). Few rows (decode) go through a C++ kernel that reads each int8 weight
  once (bandwidth-bound: a quarter of float32's bytes). More rows are compute-bound: they
  multiply in bfloat16 (twice float32's rate on AVX-512-BF16 CPUs) by the int8 values, which
  bfloat16 holds exactly. On the CPU with oneDNN that bfloat16 copy is made once and prepacked
  (`weight_bf16`; 3 bytes per weight in all, still under float32's 4; converting on every call
  cost a third of a decode step); elsewhere it is converted per call. Both paths compute the
  same thing, so a row's result does not depend on how many rows share the matmul:
  activations rounded to bfloat16, products summed in float32, the sum rounded to bfloat16,
  then scaled in float32.

Row buckets: oneDNN (the prepacked matmul, and `F.linear` in bfloat16 on the CPU) builds and
caches a primitive for every distinct (rows, weight shape) it is called with, about 0.6-1.4 MiB
each, held by two LRU caches of 1024 entries (oneDNN's primitive cache and ideep's), and glibc
keeps the heap of evicted ones. A step's row count is the number of tokens it schedules, any
value up to `max_num_batched_tokens`, so serving varied traffic grew the engine by ~2.7 MiB per
new row count on the demo model, to ~1.4 GiB more before it levelled off (see the soak section
of docs/operations.md). These paths therefore pad the rows up to `row_bucket(rows)`: every count
up to 16, then 8 sizes per doubling (at most 12.5% padding; 72 sizes up to 2048), which bounds
the primitives to a few hundred that are built once and stay cached. Padding rows are zeros and
sliced off.

Batch invariance (`batch_invariant=True`): the row buckets bound the primitives but do not make
a row's result independent of how many rows share the matmul: oneDNN (and MKL) pick their
kernel and their blocking of the sum by the row count, so the same token can round differently
in a step of 3 rows and one of 64 (seen on the demo model: one greedy answer of 600 changed
between --max-num-seqs 16 and 3; on an AMX Xeon the down projection's rows differ in the last
bit between a 64-row matmul and the same rows alone). A
batch-invariant method therefore runs every matmul in tiles of exactly `INVARIANT_TILE` rows
(the last padded with zeros): every row goes through the one primitive built for that shape,
whatever the step holds. `PackedF32Method` needs no tiles (each row keeps its own accumulators
and sums K in one order for any row count); int8 skips its few-rows kernel, which sums in
another order than the tiled bfloat16 path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qiao import envs
from qiao.errors import ConfigError
from qiao.kernels import ops_for

if TYPE_CHECKING:
    from qiao.layers.linear import LinearBase

logger = logging.getLogger(__name__)

# Row buckets (see the module docstring): exact up to 2 * _BUCKETS_PER_OCTAVE rows, then this
# many evenly spaced sizes per doubling. A test switch: False passes every row count through.
ROW_BUCKETS = True
_BUCKETS_PER_OCTAVE = 8
_OCTAVE_SHIFT = _BUCKETS_PER_OCTAVE.bit_length()  # log2(_BUCKETS_PER_OCTAVE) + 1

# Rows per matmul up to which the int8 kernel beats convert-then-bfloat16-matmul (measured on a
# 2-core AVX-512 machine at 135M and 0.5B decode shapes: the kernel wins through 8 rows).
INT8_KERNEL_MAX_ROWS = 8

# Rows per matmul of a batch-invariant method (see the module docstring). On the SmolLM2-135M
# shape in bfloat16 (AMX Xeon, 2 cores; 32 prompts of 64-256 tokens, 32 tokens each, beside the
# untiled engine in one run) tiles of 16 rows cost 1.29x the time, 32 rows 1.04x, 64 rows 1.19x:
# few rows per call starve the matmul on prompts, many waste it on decode steps.
INVARIANT_TILE = 32


def row_bucket(rows: int) -> int:
    """The row count a oneDNN matmul of `rows` rows runs at: `rows` itself up to 16, then the
    next multiple of 1/8 of the power of two below it (17 -> 18, 33 -> 36, 65 -> 72,
    1025 -> 1152; powers of two stay)."""
    if rows <= 2 * _BUCKETS_PER_OCTAVE:
        return rows
    step = 1 << ((rows - 1).bit_length() - _OCTAVE_SHIFT)
    return -(-rows // step) * step


def bucketed_matmul(
    matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """`matmul(x)` for x [..., K], run on rows padded with zeros to `row_bucket(rows)` and
    sliced back, so the matmul only ever sees a bounded set of row counts."""
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    bucket = row_bucket(rows) if ROW_BUCKETS else rows
    if bucket == rows:
        return matmul(x)
    flat = x.reshape(rows, x.shape[-1])
    out = matmul(F.pad(flat, (0, 0, 0, bucket - rows)))[:rows]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def tiled_matmul(
    matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int
) -> torch.Tensor:
    """`matmul(x)` for x [..., K] computed `tile` rows at a time, the last tile padded with
    zeros: every row goes through a matmul of exactly `tile` rows (batch invariance)."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    padded = -(-rows // tile) * tile
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    out = torch.cat([matmul(flat[i : i + tile]) for i in range(0, padded, tile)])[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class LinearMethod:
    """Turns a loaded layer's `weight` into this method's storage, then computes with it.

    `tile`: None, or the rows per matmul of a batch-invariant method (`tiled_matmul`)."""

    name = "dense"

    def __init__(self, tile: int | None = None) -> None:
        self.tile = tile

    def prepare(self, layer: LinearBase) -> None:
        pass

    def rows_matmul(
        self, matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """`matmul(x)` in tiles when batch-invariant, else on the rows' bucket."""
        if self.tile is not None:
            return tiled_matmul(matmul, x, self.tile)
        return bucketed_matmul(matmul, x)

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        """The fewest rows whose matmul `apply` runs on a row bucket for inputs of `dtype`, or
        None when it buckets none (`warm_row_buckets`)."""
        if self.tile is None and dtype == torch.bfloat16 and layer.weight.device.type == "cpu":
            return 1
        return None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and (x.dtype == torch.bfloat16 or self.tile is not None):
            # The CPU's bfloat16 F.linear is a oneDNN matmul too (see row_bucket).
            return self.rows_matmul(lambda rows: F.linear(rows, layer.weight, layer.bias), x)
        return F.linear(x, layer.weight, layer.bias)


DenseMethod = LinearMethod


class OneDnnMethod(LinearMethod):
    name = "onednn"

    def __init__(self, batch_hint: int, tile: int | None = None) -> None:
        super().__init__(tile)
        self.batch_hint = tile or batch_hint

    def prepare(self, layer: LinearBase) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), self.batch_hint)
        _replace_weight(layer, packed)

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        return 1 if self.tile is None else None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self.rows_matmul(
            lambda rows: torch.ops.mkldnn._linear_pointwise(
                rows, layer.weight, layer.bias, "none", [], ""
            ),
            x,
        )


class PackedF32Method(LinearMethod):
    name = "packed-f32"

    def __init__(self, ops: ModuleType) -> None:
        super().__init__()
        self.ops = ops

    def prepare(self, layer: LinearBase) -> None:
        _replace_weight(layer, self.ops.pack_linear_f32(layer.weight.detach().contiguous()))

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        return None  # qiao's own kernel: no primitive per shape

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        bias = layer.bias if layer.bias is not None else _EMPTY
        out = self.ops.linear_f32(rows, layer.weight, layer.output_size, bias)
        return out.reshape(*shape[:-1], layer.output_size)


class Int8Method(LinearMethod):
    name = "int8"

    def __init__(self, batch_hint: int = 64, tile: int | None = None) -> None:
        super().__init__(tile)
        self.batch_hint = tile or batch_hint

    def prepare(self, layer: LinearBase) -> None:
        qweight, scale = quantize_int8(layer.weight.detach())
        _replace_weight(layer, qweight)
        layer.register_buffer("weight_scale", scale, persistent=False)
        packed = None
        if qweight.device.type == "cpu" and onednn_linear_available(torch.bfloat16):
            packed = torch.ops.mkldnn._reorder_linear_weight(
                qweight.to(torch.bfloat16), self.batch_hint
            )
        layer.register_buffer("weight_bf16", packed, persistent=False)

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        # Up to INT8_KERNEL_MAX_ROWS rows go to the int8 kernel, more to the bfloat16 matmul.
        if self.tile is None and layer.weight_bf16 is not None:
            return INT8_KERNEL_MAX_ROWS + 1
        return None

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        ops = ops_for(rows)
        if ops is not None and rows.shape[0] <= INT8_KERNEL_MAX_ROWS and self.tile is None:
            bias = layer.bias.float() if layer.bias is not None else _EMPTY
            out = ops.int8_linear(rows.float(), layer.weight, layer.weight_scale, bias)
        elif layer.weight_bf16 is not None:
            out = self.rows_matmul(
                lambda r: torch.ops.mkldnn._linear_pointwise(
                    r, layer.weight_bf16, None, "none", [], ""
                ),
                rows,
            )
            out = out.float().mul_(layer.weight_scale)
            if layer.bias is not None:
                out.add_(layer.bias.float())
        elif self.tile is not None:
            out = tiled_matmul(
                lambda r: int8_linear_reference(r, layer.weight, layer.weight_scale, layer.bias),
                rows,
                self.tile,
            )
        else:
            out = int8_linear_reference(rows, layer.weight, layer.weight_scale, layer.bias)
        return out.to(x.dtype).reshape(*shape[:-1], out.shape[-1])


_EMPTY = torch.empty(0)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]) with weight ~= int8 * scale[:, None]."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scale


def int8_linear_reference(
    rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bfloat16 rows [M, K] x int8 [N, K] -> float32 [M, N]; the kernel's oracle and fallback.

    int8 values are exact in bfloat16, so the matmul sees the weight exactly; its bfloat16 output
    is scaled in float32.
    """
    out = F.linear(rows, qweight.to(rows.dtype)).float().mul_(scale)
    return out if bias is None else out.add_(bias.float())


def choose_method(
    weight: torch.Tensor,
    *,
    quantization: str | None,
    batch_hint: int,
    batch_invariant: bool = False,
) -> LinearMethod:
    tile = None
    if batch_invariant:
        if weight.device.type != "cpu":
            raise ConfigError(
                f"batch_invariant runs on the CPU only (the model is on {weight.device}); "
                "leave it off on this device"
            )
        tile = INVARIANT_TILE
    if quantization == "int8":
        return Int8Method(max(16, min(batch_hint, 128)), tile)
    if quantization == "int4":
        from qiao.layers.quant_int4 import Int4Method  # its own module; it imports this one

        return Int4Method(batch_hint, tile)
    if quantization == "w8a8":
        from qiao.layers.quant_w8a8 import W8A8Method  # its own module; it imports this one

        return W8A8Method()  # batch-invariant as it is: exact integer sums per row
    packed = packed_f32_ops(weight)
    if packed is not None:
        return PackedF32Method(packed)
    onednn = (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and not envs.disable_onednn_linear()
        and onednn_linear_available(weight.dtype)
    )
    if onednn:
        return OneDnnMethod(max(16, min(batch_hint, 128)), tile)
    return DenseMethod(tile)


def packed_f32_ops(weight: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when `weight` can use `PackedF32Method` (CPU, float32, AVX-512 build)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if envs.disable_packed_linear():
        return None
    ops = ops_for(weight)
    return ops if ops is not None and ops.linear_f32_available() else None


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU run oneDNN's prepacked linear in `dtype` (and it computes
    F.linear). Per dtype: oneDNN's bfloat16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so
    an AVX2-only CPU has it in float32 but not in bfloat16."""
    try:
        w, x = torch.randn(8, 16).to(dtype), torch.randn(3, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=tolerance))
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN prepacked %s linear unavailable (%s); using F.linear", dtype, exc)
        return False


def _replace_weight(layer: LinearBase, weight: torch.Tensor) -> None:
    """Swap the loaded parameter for the method's storage (a tied weight stays with its owner)."""
    del layer.weight
    layer.register_buffer("weight", weight, persistent=False)


def bucket_sizes(max_rows: int) -> list[int]:
    """Every row count `row_bucket` gives for 1..max_rows (72 sizes up to 2048)."""
    return sorted({row_bucket(rows) for rows in range(1, max_rows + 1)})


def warm_row_buckets(
    model: torch.nn.Module, dtype: torch.dtype, max_rows: int, head_rows: int
) -> int:
    """Run every oneDNN-backed linear shape of `model` once at each row bucket up to `max_rows`
    (the head, `lm_head`, up to `head_rows`: one row per sequence), so oneDNN builds every
    matmul primitive the engine will ever use now. Its memory is then paid at start, a known
    amount, and stays flat under load instead of stepping up as rare step sizes first appear
    (docs/operations.md, the soak). Returns the matmuls run (0 where nothing is bucketed).
    One layer per distinct weight shape is enough: the primitive cache is keyed by shapes."""
    if not ROW_BUCKETS:
        return 0
    seen: set[tuple] = set()
    runs = 0
    with torch.inference_mode():
        for name, module in model.named_modules():
            method = getattr(module, "method", None)
            if not isinstance(method, LinearMethod):
                continue
            smallest = method.bucketed_from(module, dtype)
            if smallest is None:
                continue
            weight = module.weight
            is_head = name.endswith("lm_head")
            key = (type(method), tuple(weight.shape), weight.dtype, module.input_size, is_head)
            if key in seen:
                continue
            seen.add(key)
            for rows in bucket_sizes(head_rows if is_head else max_rows):
                if rows >= smallest:
                    method.apply(module, torch.zeros(rows, module.input_size, dtype=dtype))
                    runs += 1
    return runs
