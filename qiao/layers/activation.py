"""Gated activations applied to a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qiao.kernels import ops_for


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> silu(gate) * up, [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x)
        if ops is not None and x.is_contiguous():
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
