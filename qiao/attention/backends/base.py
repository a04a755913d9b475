"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qiao.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over one step's flat token batch.

    Backends hold no per-step state, so one instance serves every layer.
    """

    name: str

    @abstractmethod
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
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V in `kv_cache`, then attend every query token causally.

        query [T, H, D]; key and value [T, Hkv, D]; kv_cache
        [2, num_blocks, block_size, Hkv, D]. Returns [T, H, D]. The K/V of the whole batch is in
        the cache before any token attends, so a sequence may read blocks another sequence of
        the same step writes (a prefix shared within one step). The query at position p sees
        the keys at positions <= p, and > p - sliding_window when a window is set. With
        `softcap`, each score s = scale * q.k becomes softcap * tanh(s / softcap) before the
        softmax.

        Blocks of a sequence's table wholly before its first query's window may have been freed
        (and handed to another request): a backend must not let what they hold reach the output.
        """
