"""Rotary position embedding in Hugging Face's `rotate_half` layout.

A head vector [x1 | x2] (halves of D/2) rotates pairwise (x1[i], x2[i]) by position * inv_freq[i].
cos/sin are computed once per forward from the step's positions, in float32, exactly as
transformers computes them, and cast to the activation dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qiao.errors import ConfigError
from qiao.kernels import ops_for

ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def validate_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """Raise ConfigError unless `rope_scaling` is None or a supported, complete scaling."""
    if rope_scaling is None:
        return
    rope_type = rope_scaling.get("rope_type", "default")
    if rope_type not in _REQUIRED_KEYS:
        raise ConfigError(
            f"rope_scaling.rope_type: unsupported value {rope_type!r}; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    for key in _REQUIRED_KEYS[rope_type]:
        if key not in rope_scaling:
            raise ConfigError(f"rope_scaling.{key}: required for rope_type {rope_type!r}")


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies on the CPU (also under a meta device)."""
    validate_rope_scaling(rope_scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slow down by `factor`, short ones stay, and the
    band between `high_freq_factor` and `low_freq_factor` wavelengths interpolates smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """positions [T] -> (cos, sin), each [T, head_dim], shared by every layer of a forward."""

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        # A plain tensor, not a buffer: no checkpoint holds it, and to_empty() must not wipe it.
        self.inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, D]. May rotate x in place and return it."""
    ops = ops_for(x)
    if ops is not None and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        ops.rotary_(x, cos, sin)
        return x
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
