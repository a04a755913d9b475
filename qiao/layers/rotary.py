"""Rotary position embedding in Hugging Face's `rotate_half` layout.

A head vector [x1 | x2] (halves of D/2) rotates pairwise (x1[i], x2[i]) by position * inv_freq[i].
cos/sin are computed once per forward from the step's positions, in float32, exactly as
transformers computes them, and cast to the activation dtype. With partial rotary (Phi-4-mini)
only the first `rotary_dim` of a head's D dims rotate, as [x1 | x2] of rotary_dim / 2 each.

Explicit per-frequency factors ("freq_factors", what a GGUF file's `rope_freqs.weight` holds:
llama.cpp's converter writes Llama 3.1 / 3.2's "llama3" scaling that way) divide the unscaled
inverse frequencies one by one: inv_freq[i] = 1 / (theta ** (2i / rotary_dim)) / factors[i].

LongRoPE (Phi-3 128k, Phi-4-mini) scales each frequency by `short_factor[i]` or `long_factor[i]`
and multiplies cos/sin by sqrt(1 + log(factor) / log(original_max_position_embeddings)).
transformers picks short or long per forward, by its largest position (long once it reaches
`original_max_position_embeddings`); qiao picks per position: a token at position p rotates with
the long factors iff p >= original_max_position_embeddings. A token's rotation then never
changes, so the keys in the paged cache stay valid and no result depends on the batch or the
chunking beside it. This equals transformers for every sequence of at most
`original_max_position_embeddings` tokens (all short: one forward, or `generate`), and its
forward over a KV cache whose prompt fits in that length (each later token long once its
position reaches it). It differs past that length from one transformers forward over the whole
sequence, and from Phi-3's `generate`, which on the first token past it drops the cache and
recomputes every position with the long factors: matching that needs the engine to recompute a
sequence's cache when it crosses, which qiao does not do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from qiao.errors import ConfigError
from qiao.kernels import ops_for

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")
_REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # `factor` defaults to max_position_embeddings / original_max_position_embeddings (ArchConfig).
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
    # qiao's own: one divisor per frequency (GGUF's rope_freqs).
    "freq_factors": ("freq_factors",),
}


def validate_rope_scaling(
    rope_scaling: dict[str, Any] | None, rotary_dim: int | None = None
) -> None:
    """Raise ConfigError unless `rope_scaling` is None or a supported, complete scaling (with
    `rotary_dim`: LongRoPE's and freq_factors' lists of rotary_dim / 2 entries)."""
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
    if rope_type in ("longrope", "freq_factors") and rotary_dim is not None:
        keys = ("freq_factors",) if rope_type == "freq_factors" else ("short_factor", "long_factor")
        for key in keys:
            if len(rope_scaling[key]) != rotary_dim // 2:
                raise ConfigError(
                    f"rope_scaling.{key}: {len(rope_scaling[key])} values, expected "
                    f"{rotary_dim // 2} (half the rotary dimension {rotary_dim})"
                )


def compute_inv_freq(
    rotary_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies on the CPU (also under a meta device);
    LongRoPE's short ones."""
    validate_rope_scaling(rope_scaling, rotary_dim)
    base = _base_frequencies(rotary_dim, rope_theta)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return 1.0 / base / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(1.0 / base, rope_scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(base, rope_scaling["short_factor"])
    if rope_type == "freq_factors":
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32, device="cpu")
        return 1.0 / base / factors
    return 1.0 / base


def _base_frequencies(rotary_dim: int, rope_theta: float) -> torch.Tensor:
    """theta ** (2i / rotary_dim): the reciprocals of the unscaled inverse frequencies."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    return rope_theta ** (exponents / rotary_dim)


def _longrope_inv_freq(base: torch.Tensor, factors: list[float]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base)


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """LongRoPE's cos/sin multiplier: `attention_factor` when given, else
    sqrt(1 + log(factor) / log(original_max_position_embeddings)), 1 for factor <= 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


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
    """positions [T] -> (cos, sin), each [T, rotary_dim], shared by every layer of a forward."""

    def __init__(
        self, rotary_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        # Plain tensors, not buffers: no checkpoint holds them, and to_empty() must not wipe them.
        self.inv_freq = compute_inv_freq(rotary_dim, rope_theta, rope_scaling)
        self.long_inv_freq: torch.Tensor | None = None  # LongRoPE's, from `long_from` on
        self.long_from = 0
        self.attention_scaling = 1.0
        if (rope_scaling or {}).get("rope_type") == "longrope":
            base = _base_frequencies(rotary_dim, rope_theta)
            self.long_inv_freq = _longrope_inv_freq(base, rope_scaling["long_factor"])
            self.long_from = rope_scaling["original_max_position_embeddings"]
            self.attention_scaling = longrope_attention_factor(rope_scaling)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:
            if self.long_inv_freq.device != positions.device:
                self.long_inv_freq = self.long_inv_freq.to(positions.device)
            is_long = positions[:, None] >= self.long_from
            inv_freq = torch.where(is_long, self.long_inv_freq, self.inv_freq)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, R], R <= D: the first R dims of each head rotate,
    the other D - R pass through (partial rotary). May rotate x in place and return it."""
    rotary_dim = cos.shape[-1]
    ops = ops_for(x)
    if ops is not None and x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        # The kernel walks x by its strides, so a view of the leading dims rotates them in x.
        ops.rotary_(x[..., :rotary_dim], cos, sin)
        return x
    if rotary_dim < x.shape[-1]:
        rotated = _rotate(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
