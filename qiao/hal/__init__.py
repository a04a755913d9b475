"""Hardware abstraction: which device runs the model, in which dtype, with how much memory."""

from qiao.hal.platform import (
    Platform,
    available_memory_bytes,
    current_platform,
    default_device,
    resolve_dtype,
    total_memory_bytes,
)

__all__ = [
    "Platform",
    "available_memory_bytes",
    "current_platform",
    "default_device",
    "resolve_dtype",
    "total_memory_bytes",
]
