"""Decode attention with static shapes, so a whole decode step can be captured as a CUDA graph.

A padded decode step (`AttentionMetadata.is_padded_decode`) has exactly one query token per
sequence and a fixed-width block table: `[num_seqs, num_blocks]`, where `num_seqs` and
`num_blocks` are the runner's bucket sizes, not the step's. Every tensor shape is therefore a
function of the bucket alone, and no operation reads a value on the host. Each sequence's
context is gathered through its block table into `[num_seqs, num_blocks * block_size, Hkv, D]`
and masked by `seq_lens`; the price of static shapes is attention over the bucket's full
context width rather than the step's longest sequence.

Grouped heads need no repeated K/V: query head h reads kv head h // G (G = H / Hkv), so the query
`[S, H, D]` is viewed as `[S, Hkv, G, D]` and each kv head's G query heads ride in the query
length dimension of one `scaled_dot_product_attention` call.

Every other step goes to the fallback backend, so the runner installs this backend on every
attention layer once and the eager path is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qiao.attention.backends.base import AttentionBackend
from qiao.attention.backends.torch_ref import softcapped_attention, write_kv
from qiao.attention.metadata import AttentionMetadata
from qiao.attention.registry import get_attention_backend, resolve_backend_name


class PaddedDecodeBackend(AttentionBackend):
    """Padded decode steps here; every other step through `fallback`.

    `fallback` None means the device's default backend, resolved on first use.
    """

    name = "padded_decode"

    def __init__(self, fallback: AttentionBackend | None = None) -> None:
        self.fallback = fallback

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
        if not metadata.is_padded_decode:
            return self._fallback(kv_cache.device).forward(
                query,
                key,
                value,
                kv_cache,
                metadata,
                scale=scale,
                num_kv_heads=num_kv_heads,
                sliding_window=sliding_window,
                softcap=softcap,
            )
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        return padded_decode_attention(
            query,
            kv_cache,
            metadata.block_tables,
            metadata.seq_lens,
            scale,
            sliding_window,
            softcap,
        )

    def _fallback(self, device: torch.device) -> AttentionBackend:
        if self.fallback is not None:
            return self.fallback
        return get_attention_backend(resolve_backend_name("auto", device))


def padded_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached context, with shapes fixed by the inputs'.

    query [S, H, D], the token at position seq_lens[i] - 1 of sequence i (its K/V already in
    the cache); kv_cache [2, num_blocks_total, block_size, Hkv, D]; block_tables [S, W] (any
    integer dtype; entries past a sequence's blocks may be any valid block id); seq_lens [S],
    each >= 1. Returns [S, H, D]. The query sees keys at positions < seq_lens[i], and
    >= seq_lens[i] - sliding_window when a window is set; scores soft-capped with `softcap`.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    # [2, num_blocks_total, B, Hkv, D] -> [2, S, W * B, Hkv, D]
    context = kv_cache[:, block_tables.long()].flatten(2, 3)
    key_positions = torch.arange(context.shape[2], device=query.device)
    seq_lens = seq_lens.long()
    is_valid = key_positions[None, :] < seq_lens[:, None]  # [S, L]
    if sliding_window is not None:
        is_valid &= key_positions[None, :] >= seq_lens[:, None] - sliding_window
    # Slots past a sequence's end may hold a stale block's values; a NaN there would survive
    # masking (0 * NaN), so the gathered copy is zeroed there, as the reference backend does.
    context.masked_fill_(~is_valid[None, :, :, None, None], 0)
    key, value = (t.to(query.dtype).transpose(1, 2) for t in context)  # [S, Hkv, L, D]
    group = num_heads // num_kv_heads
    if softcap is not None:
        mask = is_valid[:, None, None, :]  # [S, 1, 1, L]
        out = softcapped_attention(query[:, :, None], key, value, mask, scale, softcap)
        return out.reshape(num_seqs, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        query.view(num_seqs, num_kv_heads, group, head_dim),
        key,
        value,
        attn_mask=is_valid[:, None, None, :],
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)
