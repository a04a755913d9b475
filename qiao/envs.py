"""Every environment variable qiao reads, in one place. Nothing else calls `os.getenv`.

The server's own settings (`QIAO_PORT`, ...) are read by pydantic-settings in
`qiao/api/settings.py`; this module holds the process-level switches below it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """QIAO_CACHE_DIR: where compiled kernels (and, by default, tuning profiles) live
    (~/.cache/qiao)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qiao"
    return Path(os.environ.get("QIAO_CACHE_DIR", default))


def disable_cpu_kernels() -> bool:
    """QIAO_DISABLE_CPU_KERNELS=1: use the plain-PyTorch reference ops instead of the C++ ones."""
    return os.environ.get("QIAO_DISABLE_CPU_KERNELS", "0") not in ("", "0", "false")


def profile_dir() -> Path:
    """QIAO_PROFILE_DIR: where `qiao tune` writes tuning profiles and `LLM` / `qiao serve` look
    for them (default: <QIAO_CACHE_DIR>/profiles). Kept apart from the cache dir so tests can
    point it elsewhere without rebuilding the kernels cached there."""
    return Path(os.environ.get("QIAO_PROFILE_DIR", cache_dir() / "profiles"))


def disable_onednn_linear() -> bool:
    """QIAO_DISABLE_ONEDNN_LINEAR=1: CPU linear layers use F.linear on the plain weight."""
    return os.environ.get("QIAO_DISABLE_ONEDNN_LINEAR", "0") not in ("", "0", "false")


def disable_packed_linear() -> bool:
    """QIAO_DISABLE_PACKED_LINEAR=1: CPU float32 linear layers use oneDNN's prepacked matmul
    instead of qiao's AVX-512 kernel over its own packed weight."""
    return os.environ.get("QIAO_DISABLE_PACKED_LINEAR", "0") not in ("", "0", "false")


def kv_prefault() -> bool:
    """QIAO_KV_PREFAULT=0: leave the CPU KV pool to fault in on first use, instead of faulting
    all of it in on a background thread as soon as the engine is built."""
    return os.environ.get("QIAO_KV_PREFAULT", "1") not in ("", "0", "false")


def warm_row_buckets() -> bool:
    """QIAO_WARM_ROW_BUCKETS=0: build oneDNN's matmul primitives as step sizes first appear,
    instead of all of them (one per row bucket and weight shape) when the engine starts."""
    return os.environ.get("QIAO_WARM_ROW_BUCKETS", "1") not in ("", "0", "false")


def kernel_build_timeout() -> float:
    """QIAO_KERNEL_BUILD_TIMEOUT: seconds a start waits for another process's C++ kernel build
    (its lock) before giving up with an error naming the lock (default 900)."""
    return float(os.environ.get("QIAO_KERNEL_BUILD_TIMEOUT", "900"))


def engine_hook() -> str | None:
    """QIAO_ENGINE_HOOK=module:function: an engine process calls `function(engine)` once its
    `LLMEngine` is built, before it serves (fault injection in tests, tracing). Unset: nothing."""
    return os.environ.get("QIAO_ENGINE_HOOK") or None


def encoder_hook() -> str | None:
    """QIAO_ENCODER_HOOK=module:function: an encoder process calls `function(encoder)` once its
    `Encoder` is loaded, before it serves (fault injection in tests, tracing). Unset: nothing."""
    return os.environ.get("QIAO_ENCODER_HOOK") or None
