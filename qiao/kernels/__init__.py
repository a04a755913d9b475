"""Fused CPU kernels (C++), built once per machine on first use and cached.

`cpu_ops()` returns the compiled module, or None when it cannot be built (no compiler) or is
disabled with QIAO_DISABLE_CPU_KERNELS=1; callers then use the plain-PyTorch reference, which is
also the kernels' test oracle. A CPU engine asks for them while it loads (`LLMEngine`), so a
first build (about a minute on 2 cores) happens before a server reports ready, not inside its
first request.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from qiao import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# One build at a time: the engine asks from a loader thread while other code may ask too. Once
# loaded, callers (every layer, every step) read _ops without taking the lock.
_BUILD_LOCK = threading.Lock()
_NOT_LOADED = object()
_ops: ModuleType | object | None = _NOT_LOADED


def cpu_ops() -> ModuleType | None:
    global _ops
    if _ops is _NOT_LOADED:
        with _BUILD_LOCK:
            if _ops is _NOT_LOADED:
                _ops = _load()
    return _ops  # type: ignore[return-value]


def _load() -> ModuleType | None:
    if envs.disable_cpu_kernels():
        return None
    try:
        return _build()
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why once
        logger.warning("CPU kernels unavailable, using the PyTorch reference ops (%s)", exc)
        return None


def ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when `tensor` lives on the CPU and they are available, else None."""
    return cpu_ops() if tensor.device.type == "cpu" else None


def _build() -> ModuleType:
    import torch
    from torch.utils import cpp_extension

    source = _SOURCE.read_bytes()
    # One build per source text, torch version and machine (the code is built for this CPU).
    key = hashlib.sha256(source + torch.__version__.encode() + _cpu_id()).hexdigest()[:16]
    build_dir = envs.cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not (build_dir / "qiao_cpu_ops.so").exists()
    if fresh:
        logger.info(
            "building the C++ CPU kernels for this machine into %s (once per machine and "
            "version; about a minute on 2 cores)",
            build_dir,
        )
    started = time.monotonic()
    module = cpp_extension.load(
        name="qiao_cpu_ops",
        sources=[str(_SOURCE)],
        build_directory=str(build_dir),
        extra_cflags=[
            "-O3",
            "-march=native",
            "-mprefer-vector-width=512",
            "-fopenmp",
            "-fno-math-errno",
        ],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    if fresh:
        logger.info("built the C++ CPU kernels in %.0f s", time.monotonic() - started)
    return module


def _cpu_id() -> bytes:
    try:
        flags = [
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ]
        return flags[0].encode() if flags else b""
    except OSError:
        return b""
