"""Reference paged attention in plain PyTorch: runs on CPU and CUDA, and is the test oracle.

Each step's sequences split into two groups, decode (one query token) and prefill (several), so
padding queries to the longest in the group wastes little. A group is one
`scaled_dot_product_attention` call over its queries padded to [S, max_query_len, H, D] and its
contexts gathered from the cache through the block tables into [S, max_seq_len, Hkv, D].
Soft-capped scores (Gemma 2) take `softcapped_attention`, the same math written out, since SDPA
has no hook between the scores and the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qiao.attention.backends.base import AttentionBackend
from qiao.attention.metadata import AttentionMetadata
from qiao.hal.platform import to_device_async


@dataclass
class Group:
    """Where one group's padded [S, Q] query grid sits in the flat batch."""

    seq_ids: torch.Tensor  # [S] sequences of the group
    seq_lens: torch.Tensor  # [S] context lengths
    # [S, Q] flat row of each query slot. Padding slots repeat their sequence's last row, so
    # every slot has a real position and attends at least one key.
    query_rows: torch.Tensor
    query_positions: torch.Tensor  # [S, Q] position of each query slot
    # The real slots: slot `valid_slots[i]` of the flattened grid holds row `valid_rows[i]`.
    valid_slots: torch.Tensor
    valid_rows: torch.Tensor
    max_seq_len: int


class TorchRefBackend(AttentionBackend):
    name = "torch"

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
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        out = torch.empty_like(query)
        if metadata.backend_plan is None:
            metadata.backend_plan = _plan_groups(metadata, query.device)
        for group in metadata.backend_plan:
            grid = attend_group(query, kv_cache, metadata, group, scale, sliding_window, softcap)
            out[group.valid_rows] = grid.flatten(0, 1)[group.valid_slots]
        return out


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # [2, num_blocks, block_size, Hkv, D] -> [2, num_slots, Hkv, D]
    slots = kv_cache.flatten(1, 2)
    slots[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    slots[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _plan_groups(metadata: AttentionMetadata, device: torch.device) -> list[Group]:
    query_lens = metadata.query_lens_cpu[: metadata.num_seqs]
    is_decode = query_lens == 1
    groups = [np.flatnonzero(is_decode), np.flatnonzero(~is_decode)]
    return [plan_group(metadata, seq_ids, device) for seq_ids in groups if seq_ids.size]


def plan_group(metadata: AttentionMetadata, seq_ids: np.ndarray, device: torch.device) -> Group:
    query_lens = metadata.query_lens_cpu[seq_ids].astype(np.int64)
    seq_lens = metadata.seq_lens_cpu[seq_ids].astype(np.int64)
    query_starts = metadata.query_start_loc_cpu[seq_ids].astype(np.int64)
    # E.g. query_lens [3, 1], Q = 3 -> offsets [[0, 1, 2], [0, 0, 0]], valid [[T, T, T], [T, F, F]]
    slot = np.arange(query_lens.max())
    offsets = np.minimum(slot[None, :], query_lens[:, None] - 1)
    rows = query_starts[:, None] + offsets
    positions = (seq_lens - query_lens)[:, None] + offsets
    valid_slots = np.flatnonzero(slot[None, :] < query_lens[:, None])

    def to_device(array: np.ndarray) -> torch.Tensor:
        # Planned by the first layer, after the step's first kernels are queued: no host wait.
        return to_device_async(array, device)

    return Group(
        seq_ids=to_device(seq_ids.astype(np.int64)),
        seq_lens=to_device(seq_lens),
        query_rows=to_device(rows),
        query_positions=to_device(positions),
        valid_slots=to_device(valid_slots),
        valid_rows=to_device(rows.reshape(-1)[valid_slots]),
        max_seq_len=int(seq_lens.max()),
    )


def attend_group(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: Group,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the group's padded query grid: [S, Q, H, D]."""
    context = _gather_context(kv_cache, metadata, group, sliding_window)
    key, value = (t.to(query.dtype) for t in context)
    key_positions = torch.arange(group.max_seq_len, device=query.device)
    # [S, Q, K]: causal, and within the window when there is one.
    mask = key_positions[None, None, :] <= group.query_positions[:, :, None]
    if sliding_window is not None:
        mask &= key_positions[None, None, :] > group.query_positions[:, :, None] - sliding_window
    args = (query[group.query_rows].transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    if softcap is not None:
        return softcapped_attention(*args, mask[:, None], scale, softcap).transpose(1, 2)
    grid = F.scaled_dot_product_attention(
        *args, attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return grid.transpose(1, 2)


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(softcap * tanh(scale * q.k / softcap)) v over the visible keys, as Hugging Face's
    eager Gemma 2 attention computes it. query [B, H, Q, D]; key and value [B, Hkv, K, D];
    mask [B, 1, Q, K] (True: visible; every row sees at least one key). Returns [B, H, Q, D]."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)


def _gather_context(
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: Group,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's contexts as K and V of [S, max_seq_len, Hkv, D], zero past each seq_len and,
    with a window, before the first query's window (those blocks may have been freed).

    Slots past a sequence's length hold whatever the cache held (possibly NaN); masking alone
    would not stop a NaN there from reaching the output, zeroing does.
    """
    block_size = metadata.block_size
    num_blocks = -(-group.max_seq_len // block_size)
    block_table = metadata.block_tables[group.seq_ids, :num_blocks].long()
    # [2, num_blocks_total, B, Hkv, D] -> [2, S, num_blocks * B, Hkv, D]
    context = kv_cache[:, block_table].flatten(2, 3)[:, :, : group.max_seq_len]
    positions = torch.arange(group.max_seq_len, device=context.device)
    is_hidden = positions[None, :] >= group.seq_lens[:, None]
    if sliding_window is not None:
        # E.g. first query at 10, window 4: positions <= 6 are out of every query's window.
        is_hidden |= positions[None, :] <= group.query_positions[:, :1] - sliding_window
    context = context.masked_fill(is_hidden[None, :, :, None, None], 0)
    return context[0], context[1]
