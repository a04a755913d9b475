"""W8A8 linear layers (`quantization="w8a8"`): int8 weights and int8 activations, int32 sums.

- Weights: int8, symmetric per output channel (`quantize_int8`, as weight-only int8), packed once
  at `prepare` into the VNNI layout the kernel reads (`pack_w8a8`).
- Activations: quantized on every call, symmetric per row (token): scale = max |x_row| / 127,
  q = round(x * 127 / max |x_row|) (half to even), so an outlier token costs only its own row.
- Products: int8 x int8 summed exactly in int32 (|sum| <= 127 * 127 * K, far inside int32),
  then out = (sum * row_scale) * col_scale + bias in float32, returned in the input's dtype.

qiao/kernels/csrc/w8a8_ops.cpp (its own extension) quantizes the rows and dequantizes the
sums in one pass each, and holds qiao's AVX-512 VNNI GEMM: `vpdpbusd` multiplies unsigned by
signed bytes, so activations are stored as q + 128 and 128 * colsum(w) is taken back out per
column (precomputed here). The GEMM itself is oneDNN's (`torch._int_mm`) where torch has it,
measured faster here; qiao's kernel where it does not. Without the extension (no compiler,
QIAO_DISABLE_CPU_KERNELS=1) quantization and dequantization are the PyTorch reference's around
`torch._int_mm`, else everything is the float64 reference. Every path computes the same integers, so
outputs agree to float32 rounding of the dequantization.

Batch invariance comes free: a row's integers depend on that row alone (its own scale, sums
that are exact in any order and any tiling), so `batch_invariant` needs no row tiles here.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from qiao import envs
from qiao.layers.linear_method import LinearMethod, _replace_weight, quantize_int8

if TYPE_CHECKING:
    from qiao.layers.linear import LinearBase

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "csrc" / "w8a8_ops.cpp"
_NAME = "qiao_w8a8_ops"
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]
_BLOCK_COLS = 16  # output features per packed block (the kernel's kBlockCols)
# Where torch has its int8 GEMM on the CPU, W8A8Method uses it (a test switch: False runs
# qiao's VNNI kernel instead).
TORCH_INT_MM = True
_LOAD_LOCK = threading.Lock()
_ops: list[ModuleType | None] = []  # [] until first asked, then [module or None]


def w8a8_ops() -> ModuleType | None:
    """The VNNI kernel's extension, or None (disabled, no VNNI in this build, build failed)."""
    if not _ops:
        with _LOAD_LOCK:
            if not _ops:
                _ops.append(_load())
    return _ops[0]


def _load() -> ModuleType | None:
    if envs.disable_cpu_kernels():
        return None
    from qiao.kernels import load_or_build

    try:
        ops = load_or_build(_NAME, _SOURCE, _CFLAGS, _LDFLAGS)
    except Exception as exc:  # no compiler, headers missing: fall back, say why once
        logger.warning("W8A8 kernel unavailable, using torch's int8 matmul (%s)", exc)
        return None
    if not ops.w8a8_available():
        logger.info("this CPU build has no AVX-512 VNNI; W8A8 uses torch's int8 matmul")
        return None
    return ops


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], float32 scale [M]) with x ~= q * scale[:, None]; a zero
    row gives zeros and scale 0. The kernel's `quantize_rows` computes the same bytes (+ 128)."""
    x = x.float()
    amax = x.abs().amax(dim=1)
    # A true division (`127.0 / amax` is computed as amax.reciprocal() * 127: other roundings).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div_(amax), torch.zeros_like(amax))
    q = torch.round(x * inv[:, None]).clamp(-127, 127).to(torch.int8)
    return q, amax / 127.0


def int_matmul_reference(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> the exact int32 sums [M, N], by float64 products (exact:
    every partial sum is an integer far below 2^53)."""
    return (q.double() @ qweight.double().T).to(torch.int32)


def dequantize(
    acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int32 sums [M, N] -> float32 (sum * x_scale[m]) * w_scale[n] + bias[n]."""
    out = acc.float().mul_(x_scale[:, None]).mul_(w_scale)
    return out if bias is None else out.add_(bias.float())


def w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] x int8 [N, K] (per-channel `w_scale`) -> [M, N] in x's dtype; the oracle."""
    q, x_scale = quantize_rows_reference(x)
    return dequantize(int_matmul_reference(q, qweight), x_scale, w_scale, bias).to(x.dtype)


def pack_w8a8(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (packed [NB, K4, 16, 4], comp int32 [NB * 16]), NB = ceil(N / 16),
    K4 = ceil(K / 4): packed[b, k4, j, i] = w[16 b + j, 4 k4 + i] (zeros past N and K), one
    64-byte vector per (block, k4); comp = 128 * colsum(w), the kernel's uint8 shift undone."""
    n, k = qweight.shape
    nb, k4 = -(-n // _BLOCK_COLS), -(-k // 4)
    padded = torch.zeros(nb * _BLOCK_COLS, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = qweight
    packed = padded.view(nb, _BLOCK_COLS, k4, 4).permute(0, 2, 1, 3).contiguous()
    comp = padded.sum(dim=1, dtype=torch.int32).mul_(128)
    return packed, comp


@functools.cache
def int_mm_available() -> bool:
    """Whether torch multiplies int8 x int8 -> int32 here (`torch._int_mm` on the CPU)."""
    try:
        a = torch.ones(3, 8, dtype=torch.int8)
        return bool((torch._int_mm(a, a.T.contiguous()) == 8).all())
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        logger.info("torch._int_mm unavailable on the CPU (%s); W8A8 uses the reference", exc)
        return False


class W8A8Method(LinearMethod):
    """The integer sums come from oneDNN's int8 GEMM through `torch._int_mm` where torch has
    it on the CPU (`TORCH_INT_MM`; on the 135M shapes at 64 rows it ran 1.5-2x qiao's VNNI
    kernel, docs/quantization.md), with qiao's fused per-row quantization before it and
    dequantization after it; else from qiao's kernel over the packed weight."""

    name = "w8a8"

    def prepare(self, layer: LinearBase) -> None:
        qweight, scale = quantize_int8(layer.weight.detach())
        bias = layer.bias.detach().float().contiguous() if layer.bias is not None else None
        _replace_weight(layer, qweight)
        layer.register_buffer("weight_scale", scale, persistent=False)
        layer.register_buffer("bias_f32", bias, persistent=False)
        packed = comp = None
        on_cpu = qweight.device.type == "cpu"
        if on_cpu and w8a8_ops() is not None and not (TORCH_INT_MM and int_mm_available()):
            packed, comp = pack_w8a8(qweight)
        layer.register_buffer("weight_packed", packed, persistent=False)
        layer.register_buffer("weight_comp", comp, persistent=False)

    def bucketed_from(self, layer: LinearBase, dtype: torch.dtype) -> int | None:
        return None  # integer matmuls, no oneDNN primitive per row count

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if rows.dtype not in (torch.float32, torch.bfloat16):
            rows = rows.float()
        ops = w8a8_ops() if rows.device.type == "cpu" else None
        bias = layer.bias_f32 if layer.bias_f32 is not None else _EMPTY
        if ops is not None and layer.weight_packed is not None:
            xq, x_scale = ops.quantize_rows(rows.contiguous(), True)
            out = ops.w8a8_linear(
                xq,
                x_scale,
                layer.weight_packed,
                layer.weight_comp,
                layer.weight_scale,
                bias,
                layer.output_size,
                rows.dtype,
            )
        elif ops is not None and int_mm_available():
            q, x_scale = ops.quantize_rows(rows.contiguous(), False)
            acc = torch._int_mm(q, layer.weight.T)
            out = ops.dequantize_rows(acc, x_scale, layer.weight_scale, bias, rows.dtype)
        else:
            q, x_scale = quantize_rows_reference(rows)
            if rows.device.type == "cpu" and int_mm_available():
                acc = torch._int_mm(q, layer.weight.T)
            else:
                acc = int_matmul_reference(q, layer.weight)
            out = dequantize(acc, x_scale, layer.weight_scale, layer.bias_f32)
        return out.to(x.dtype).reshape(*shape[:-1], layer.output_size)


_EMPTY = torch.empty(0)
