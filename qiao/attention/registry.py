"""Attention backends by name; each is imported only when first asked for."""

from __future__ import annotations

import functools
import importlib

from qiao.attention.backends.base import AttentionBackend
from qiao.errors import ConfigError

# name -> (module, class)
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("qiao.attention.backends.torch_ref", "TorchRefBackend"),
}


def available_attention_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


@functools.cache
def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """The shared instance of backend `name`."""
    if name not in _BACKENDS:
        allowed = ", ".join(_BACKENDS)
        raise ConfigError(f"attention_backend: unknown backend {name!r}; allowed: {allowed}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()
