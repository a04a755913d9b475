"""The attention layer models call: one per decoder layer, owning that layer's KV cache."""

from __future__ import annotations

import torch
from torch import nn

from qiao.attention.backends.base import AttentionBackend
from qiao.attention.metadata import AttentionMetadata
from qiao.attention.registry import get_attention_backend, resolve_backend_name


class Attention(nn.Module):
    """Paged multi-head attention with grouped K/V heads, after the q/k/v projections.

    `kv_cache` ([2, num_blocks, block_size, num_kv_heads, head_dim]) is bound by the runner
    after the model is built; it is not a parameter or buffer, so it stays out of state_dict.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        backend: str = "auto",
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        # Scores soft-capped as `softcap * tanh(score / softcap)` before the softmax (Gemma 2).
        self.softcap = softcap
        # Resolved on the first forward, when the device is known ("auto" depends on it).
        self.backend_name = backend
        self.backend: AttentionBackend | None = None
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H*D], k and v [T, Hkv*D] -> [T, H*D]."""
        if self.kv_cache is None:
            raise RuntimeError("no KV cache bound to this attention layer (bind_kv_caches)")
        if self.backend is None:
            name = resolve_backend_name(self.backend_name, self.kv_cache.device)
            self.backend = get_attention_backend(name)
        out = self.backend.forward(
            q.view(-1, self.num_heads, self.head_dim),
            k.view(-1, self.num_kv_heads, self.head_dim),
            v.view(-1, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            metadata,
            scale=self.scale,
            num_kv_heads=self.num_kv_heads,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        return out.flatten(1)
