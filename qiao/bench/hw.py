"""This machine's ceilings: memory-copy bandwidth and matmul rates per dtype.

Every other benchmark reports its speed as a share of these: decode reads every weight once per
step, so its floor is weight bytes / copy bandwidth; prefill multiplies big matrices, so its
ceiling is the matmul rate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from qiao.layers.linear import LinearBase
from qiao.layers.linear_method import (
    DenseMethod,
    Int8Method,
    LinearMethod,
    OneDnnMethod,
    PackedF32Method,
    onednn_linear_available,
    packed_f32_ops,
)
from qiao.profile import cpu_model

# (M, K, N): activations [M, K] times weights [K, N]. Decode multiplies a few rows by a weight
# matrix (reads dominate); prefill multiplies hundreds of rows (compute dominates).
DECODE_SHAPES = ((1, 2048, 2048), (1, 2048, 8192), (16, 2048, 2048), (64, 2048, 2048))
PREFILL_SHAPES = ((512, 2048, 2048), (512, 2048, 8192))
QUICK_SHAPES = ((1, 1024, 1024), (256, 1024, 1024))
DTYPES = ("float32", "bfloat16", "int8")
COPY_MIB = 256
QUICK_COPY_MIB = 32


@dataclass(frozen=True)
class MatmulResult:
    dtype: str  # "int8": qiao's weight-only int8 (int8 weights, per-channel scales)
    impl: str  # "torch" (F.linear), "onednn" (weight prepacked once), "qiao" (qiao's kernels)
    m: int
    k: int
    n: int
    seconds: float  # median of one call
    gflops: float  # 2*M*K*N / seconds / 1e9
    weight_gbps: float  # weight bytes read / seconds / 1e9


@dataclass
class HwReport:
    device: str
    num_threads: int
    copy_gbps: float  # (bytes read + bytes written) / seconds / 1e9, median
    copy_mib: int
    matmuls: list[MatmulResult] = field(default_factory=list)

    def ceiling_gflops(self, dtype: str) -> float | None:
        """The best matmul rate measured for `dtype`: the compute ceiling."""
        rates = [r.gflops for r in self.matmuls if r.dtype == dtype]
        return max(rates) if rates else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ceiling_gflops"] = {dt: self.ceiling_gflops(dt) for dt in DTYPES}
        return d


def median_time(fn: Callable[[], object], min_time: float, min_iters: int = 3) -> float:
    """Median seconds of one `fn()` call, after a warm-up call, over at least `min_iters`
    calls and `min_time` seconds."""
    fn()
    times: list[float] = []
    total = 0.0
    while len(times) < min_iters or total < min_time:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        total += times[-1]
    return statistics.median(times)


def measure_copy_gbps(size_mib: int = COPY_MIB, runs: int = 5) -> float:
    """Copy bandwidth of a `size_mib` tensor, far larger than caches: read + write bytes/s."""
    src = torch.ones(size_mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), min_time=0.0, min_iters=runs)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def impls_for(dtype: str) -> tuple[str, ...]:
    """The ways this machine multiplies in `dtype`; the ceiling is the best of them."""
    if dtype == "int8":
        return ("qiao",)
    impls = ["torch"]
    if dtype in ("float32", "bfloat16") and onednn_linear_available(getattr(torch, dtype)):
        impls.append("onednn")
    if dtype == "float32" and packed_f32_ops(torch.empty(0)) is not None:
        impls.append("qiao")
    return tuple(impls)


def measure_matmul(
    dtype: str, m: int, k: int, n: int, min_time: float, impl: str = "torch"
) -> MatmulResult:
    layer = _linear(dtype, k, n, impl)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x = x.to(getattr(torch, "float32" if dtype == "int8" else dtype))
    seconds = median_time(lambda: layer(x), min_time)
    weight_bytes = layer.weight.numel() * layer.weight.element_size()  # int8: the int8 tensor
    return MatmulResult(
        dtype,
        impl,
        m,
        k,
        n,
        seconds,
        2 * m * k * n / seconds / 1e9,
        weight_bytes / seconds / 1e9,
    )


def _linear(dtype: str, k: int, n: int, impl: str) -> LinearBase:
    """A [K -> N] linear layer computing as `impl` does, weights stored [N, K] as nn.Linear's."""
    layer = LinearBase(k, n, bias=False)
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    layer.weight.data = weight.to(torch.float32 if dtype == "int8" else getattr(torch, dtype))
    layer.method = _method(dtype, impl)
    layer.method.prepare(layer)
    return layer


def _method(dtype: str, impl: str) -> LinearMethod:
    if impl == "torch":
        return DenseMethod()
    if impl == "onednn":
        return OneDnnMethod(64)
    if dtype == "int8":
        return Int8Method()
    ops = packed_f32_ops(torch.empty(0))
    assert ops is not None, "impls_for offers qiao float32 only where the kernel exists"
    return PackedF32Method(ops)


@torch.inference_mode()
def run_hw(
    dtypes: tuple[str, ...] = DTYPES, quick: bool = False, min_time: float | None = None
) -> HwReport:
    """Measure copy bandwidth and every (dtype, shape) matmul. `quick`: small sizes, for tests
    and for the in-run ceiling of other benchmarks."""
    shapes = QUICK_SHAPES if quick else DECODE_SHAPES + PREFILL_SHAPES
    min_time = min_time if min_time is not None else (0.05 if quick else 0.25)
    copy_mib = QUICK_COPY_MIB if quick else COPY_MIB
    report = HwReport(
        device=_device_name(),
        num_threads=torch.get_num_threads(),
        copy_gbps=measure_copy_gbps(copy_mib),
        copy_mib=copy_mib,
    )
    for dtype in dtypes:
        report.matmuls.extend(
            measure_matmul(dtype, m, k, n, min_time, impl)
            for m, k, n in shapes
            for impl in impls_for(dtype)
        )
    return report


@torch.inference_mode()
def measure_ceiling_gflops(dtype: str = "float32", quick: bool = False) -> float:
    """The matmul ceiling alone: the best rate over the prefill shapes (quick: one small one)."""
    shapes = QUICK_SHAPES[-1:] if quick else PREFILL_SHAPES
    min_time = 0.05 if quick else 0.3
    return max(
        measure_matmul(dtype, m, k, n, min_time, impl).gflops
        for m, k, n in shapes
        for impl in impls_for(dtype)
    )


def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_model()


def format_hw(report: HwReport) -> str:
    lines = [
        f"device: {report.device}, torch threads: {report.num_threads}",
        f"memory copy bandwidth: {report.copy_gbps:.1f} GB/s (read + write, "
        f"{report.copy_mib} MiB tensor, median)",
        "",
        f"{'dtype':<9} {'impl':<7} {'M':>5} {'K':>5} {'N':>5} {'ms':>9} {'GFLOP/s':>9} "
        f"{'weight GB/s':>12}",
    ]
    for r in report.matmuls:
        lines.append(
            f"{r.dtype:<9} {r.impl:<7} {r.m:>5} {r.k:>5} {r.n:>5} {r.seconds * 1e3:>9.3f} "
            f"{r.gflops:>9.1f} {r.weight_gbps:>12.1f}"
        )
    lines.append("")
    for dtype in DTYPES:
        ceiling = report.ceiling_gflops(dtype)
        if ceiling is not None:
            lines.append(f"ceiling {dtype}: {ceiling:.1f} GFLOP/s")
    return "\n".join(lines)
