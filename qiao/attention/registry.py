"""Attention backends by name; each is imported only when first asked for."""

from __future__ import annotations

import functools
import importlib

import torch

from qiao.attention.backends.base import AttentionBackend
from qiao.errors import ConfigError

# name -> (module, class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("qiao.attention.backends.torch_ref", "TorchRefBackend"),
    "cpu": ("qiao.attention.backends.cpu_paged", "CpuPagedBackend"),
    # Every row through the paged kernel, whatever the step holds (batch invariance).
    "cpu_invariant": ("qiao.attention.backends.cpu_paged", "CpuInvariantBackend"),
    # Static-shape decode (CUDA graphs); other steps go to the device's default backend.
    "padded_decode": ("qiao.attention.backends.padded_decode", "PaddedDecodeBackend"),
}


def available_attention_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """ "auto" -> the fastest backend this device has: the C++ kernel on CPU when it builds."""
    if name != "auto":
        return name
    if device.type == "cpu":
        from qiao.kernels import cpu_ops

        if cpu_ops() is not None:
            return "cpu"
    return "torch"


@functools.cache
def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """The shared instance of backend `name`."""
    if name not in _BACKENDS:
        allowed = ", ".join(_BACKENDS)
        raise ConfigError(f"attention_backend: unknown backend {name!r}; allowed: {allowed}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()
