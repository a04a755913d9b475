"""The device qiao runs on: its kind, the dtypes it computes in, and its memory."""

from __future__ import annotations

import functools
import platform as _host
from dataclasses import dataclass
from pathlib import Path

import torch

from qiao.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Platform:
    """The accelerator (or CPU) a process computes on."""

    device_type: str  # "cuda" or "cpu"
    device_name: str

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


@functools.cache
def current_platform() -> Platform:
    if torch.cuda.is_available():
        return Platform("cuda", torch.cuda.get_device_name())
    return Platform("cpu", _host.processor() or _host.machine())


def default_device() -> torch.device:
    return torch.device(current_platform().device_type)


def resolve_dtype(name: str, config_dtype: str | None) -> torch.dtype:
    """Map the `dtype` setting to a torch dtype.

    "auto" takes the checkpoint's own dtype (`torch_dtype` in config.json), float32 when unset.
    """
    if name == "auto":
        if config_dtype is None:
            return torch.float32
        return _lookup(config_dtype.removeprefix("torch."), "torch_dtype")
    return _lookup(name, "dtype")


def _lookup(name: str, field: str) -> torch.dtype:
    if name not in DTYPES:
        allowed = ", ".join(["auto", *DTYPES])
        raise ConfigError(f"{field}: unsupported value {name!r}; allowed: {allowed}")
    return DTYPES[name]


def total_memory_bytes(device: torch.device) -> int:
    """Physical memory of `device` (system RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _meminfo_bytes("MemTotal")


def available_memory_bytes(device: torch.device) -> int:
    """Memory `device` can still hand out now (MemAvailable for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _meminfo_bytes("MemAvailable")


def _meminfo_bytes(key: str) -> int:
    # Lines read like "MemTotal:       24531208 kB".
    for line in _MEMINFO.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"{key} not found in {_MEMINFO}")
