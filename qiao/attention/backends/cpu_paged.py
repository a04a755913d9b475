"""Paged attention with the C++ CPU kernel: reads K/V block by block through the block table.

No padded copy of any context is built; work is split over (token, kv head) pairs on all
cores. The reference backend (`torch_ref`) is its test oracle.
"""

from __future__ import annotations

import torch

from qiao.attention.backends.base import AttentionBackend
from qiao.attention.backends.torch_ref import write_kv
from qiao.attention.metadata import AttentionMetadata
from qiao.kernels import cpu_ops


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("the C++ CPU kernels are not available")
        self.ops = ops

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None,
    ) -> torch.Tensor:
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return self.ops.paged_attention(
            query.to(kv_cache.dtype).contiguous(),
            kv_cache,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            sliding_window or 0,
        ).to(query.dtype)
