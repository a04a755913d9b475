"""RMSNorm, computed in float32 whatever the activation dtype (as Hugging Face does)."""

from __future__ import annotations

import torch
from torch import nn

from qiao.kernels import ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise over the last dim. With `residual`: (norm(x + residual), x + residual).

        The fused form lets a decoder layer add its residual and normalise in one pass.
        """
        ops = ops_for(x)
        if residual is None:
            if ops is not None and x.is_contiguous():
                return ops.rms_norm(x, self.weight, self.eps)
            return self._reference(x)
        if ops is not None and x.is_contiguous() and residual.is_contiguous():
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._reference(residual), residual

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        """The weight multiplies after the cast back, as in Hugging Face."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
