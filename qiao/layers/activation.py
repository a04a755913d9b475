"""Gated activations applied to a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> silu(gate) * up, [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
