"""Gated activations applied to a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qiao.kernels import ops_for

_FUSED_DTYPES = (torch.float32, torch.bfloat16)


class SiluAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> silu(gate) * up, [..., I].

    On the CPU in float32 or bfloat16 one pass of the C++ kernel (`silu_and_mul`): it reads
    the gate and up halves where they lie and writes the product, where PyTorch copies the gate
    half out, writes silu(gate), then reads both again for the product. In bfloat16 it rounds
    silu(gate) to bfloat16 before the product as PyTorch does, so the two agree bit for bit;
    in float32 they differ by float32 rounding of exp. Elsewhere: plain PyTorch (the reference).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = ops_for(x)
        if ops is not None and x.dtype in _FUSED_DTYPES and x.is_contiguous():
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """[..., 2 * I] laid out as [gate | up] -> gelu_tanh(gate) * up, [..., I] (Gemma's
    `gelu_pytorch_tanh` gate)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
