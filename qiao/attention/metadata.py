"""The step's attention layout: what the runner tells every attention layer about the flat batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Layout of one step's flat token batch over the paged KV cache.

    The step computes `num_tokens` new tokens belonging to `num_seqs` sequences, laid out
    sequence after sequence. Sequence i owns query rows
    `query_start_loc[i] : query_start_loc[i + 1]`; those tokens sit at the last positions of its
    context, so its context after this step is `seq_lens[i]` tokens long and its first new token
    is at position `seq_lens[i] - query_len[i]`. Earlier tokens of the context are already in
    the cache (computed in an earlier step, or shared from the prefix cache).

    KV cache per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 = K, 1 = V).
    Token at position p of sequence i lives in slot
    `block_tables[i, p // block_size] * block_size + p % block_size`.
    """

    num_tokens: int
    num_seqs: int
    block_size: int
    # [num_tokens] int64: cache slot each new token's K/V is written to.
    slot_mapping: torch.Tensor
    # [num_tokens] int64: position of each new token in its sequence (same as the model input).
    positions: torch.Tensor
    # [num_seqs + 1] int32 on device. E.g. query lens [2, 5, 3] -> [0, 2, 7, 10]
    query_start_loc: torch.Tensor
    # [num_seqs] int32 on device: context length including this step's tokens.
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks_per_seq] int32 on device, padded with 0.
    block_tables: torch.Tensor
    # Host copies, so no backend needs a device sync to plan its work.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    max_query_len: int
    max_seq_len: int
    # A padded decode step (the runner's static-shape path, for CUDA graphs): one query token
    # per sequence; the device tensors are the runner's static buffers, padded to a bucket of
    # `num_seqs` sequences and `block_tables.shape[1]` blocks each. Padding rows have seq_len 1
    # and write and read only the runner's scratch block. The host copies and max_* hold the
    # bucket's capacity, not the step's lengths: backends must take no shape or value from them.
    is_padded_decode: bool = False
    # Whatever the attention backend derives from this layout, computed by the first layer and
    # reused by the others (the layout is the same for every layer of a step).
    backend_plan: Any = field(default=None, repr=False)

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)
