"""Paged attention on CPU through the C++ kernel, reading the context through the block table.

Where the kernel has its AVX-512 form (float32 / bfloat16 / float16 cache, block size a multiple of 16,
a common head size: `ops.attention_vectorized`), every row of the step, decode token or prompt
chunk, goes through it in one call: it walks each sequence's context 16 positions at a time with
no padded copy and no mask tensor, and measured faster than SDPA on prompts too (128-token
prompts, 16 at a time: 3.7 vs 6.7 ms per layer). Elsewhere the scalar kernel takes the decode
tokens, and prompt chunks go through SDPA: whole fresh prompts of one length causally over the
step's own K/V (no gather, no mask), other chunks over their gathered context (the reference
backend's path), the faster forms there. Soft-capped scores (Gemma 2): the kernel caps them
itself; prompt chunks off the kernel take the reference backend's soft-capped path (SDPA has no
cap). The reference backend is the oracle.

`CpuInvariantBackend` (batch-invariant engines) sends every row through the kernel even without
its AVX-512 form: a token's attention then never depends on whether its prompt came whole, in
chunks or after a cached prefix, nor on the rows beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from qiao.attention.backends.base import AttentionBackend
from qiao.attention.backends.torch_ref import Group, attend_group, plan_group
from qiao.attention.metadata import AttentionMetadata
from qiao.kernels import cpu_ops


@dataclass
class _Plan:
    """How one step's sequences split; computed once per step, shared by every layer."""

    all_decode: bool
    decode_seq_ids: torch.Tensor | None  # decode sequences (None when every one is)
    decode_rows: torch.Tensor | None  # their token rows in the flat batch
    decode_query_start_loc: torch.Tensor  # [n + 1]: one query each. E.g. n = 3 -> [0, 1, 2, 3]
    prefill_ids: np.ndarray | None  # sequences with more than one query (None when none)
    # Fresh prompts (no earlier context), all of one length, side by side in the flat batch:
    # (first row, number of prompts, length). Their attention is causal over their own K/V.
    fresh: tuple[int, int, int] | None = None
    # The prefill sequences' query grid over their gathered context, planned by the first layer
    # that needs it (fresh prompts never do, unless a sliding window cuts inside them).
    prefill: Group | None = None


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    # True: the kernel takes every row even without its AVX-512 form (CpuInvariantBackend).
    every_row_through_kernel = False

    def __init__(self) -> None:
        ops = cpu_ops()
        if ops is None:
            raise RuntimeError("the C++ CPU kernels are not available")
        self.ops = ops
        # attention_vectorized by (dtype, block size, head size): asked once, not per layer.
        self._vectorized: dict[tuple[torch.dtype, int, int], bool] = {}

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
        self.ops.write_kv(kv_cache, key, value, metadata.slot_mapping)
        layout = (kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[4])
        if layout not in self._vectorized:
            self._vectorized[layout] = self.ops.attention_vectorized(kv_cache)
        vectorized = self._vectorized[layout]
        if vectorized or self.every_row_through_kernel:
            # A float32 query goes in as is where the AVX-512 form reads a 16-bit cache under it.
            mixed = vectorized and query.dtype == torch.float32
            kernel_query = query if mixed else query.to(kv_cache.dtype)
            return self.ops.paged_attention(
                kernel_query.contiguous(),
                kv_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.seq_lens,
                scale,
                sliding_window or 0,
                softcap or 0.0,
            ).to(query.dtype)
        if metadata.backend_plan is None:
            metadata.backend_plan = _plan(metadata, query.device)
        plan: _Plan = metadata.backend_plan
        # The scalar kernel computes in the cache's dtype; SDPA in the query's.
        window = sliding_window
        if plan.all_decode:
            return self._decode(query, kv_cache, metadata, plan, scale, window, softcap)
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            rows = plan.decode_rows
            out[rows] = self._decode(query[rows], kv_cache, metadata, plan, scale, window, softcap)
        fresh_fits = plan.fresh is not None and (window is None or plan.fresh[2] <= window)
        if fresh_fits and softcap is None:
            first, num, length = plan.fresh
            end = first + num * length
            out[first:end] = _causal(
                query[first:end], key[first:end], value[first:end], num, length, scale
            ).to(out.dtype)
        elif plan.prefill_ids is not None:
            if plan.prefill is None:
                plan.prefill = plan_group(metadata, plan.prefill_ids, query.device)
            grid = attend_group(
                query, kv_cache, metadata, plan.prefill, scale, sliding_window, softcap
            )
            out[plan.prefill.valid_rows] = grid.flatten(0, 1)[plan.prefill.valid_slots]
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: _Plan,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        block_tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if plan.decode_seq_ids is not None:
            block_tables = block_tables[plan.decode_seq_ids]
            seq_lens = seq_lens[plan.decode_seq_ids]
        return self.ops.paged_attention(
            query.to(kv_cache.dtype).contiguous(),
            kv_cache,
            block_tables,
            plan.decode_query_start_loc,
            seq_lens,
            scale,
            sliding_window or 0,
            softcap or 0.0,
        ).to(query.dtype)


class CpuInvariantBackend(CpuPagedBackend):
    name = "cpu_invariant"
    every_row_through_kernel = True


def _causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num: int,
    length: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of `num` whole prompts of `length` tokens over their own K/V: no cache
    gather, no mask tensor. Rows [num * length, H, D] in, same out."""

    # [num * length, H, D] -> [num, H, length, D]
    def grid(t: torch.Tensor) -> torch.Tensor:
        return t.view(num, length, t.shape[1], t.shape[2]).transpose(1, 2)

    dtype = query.dtype
    out = F.scaled_dot_product_attention(
        grid(query),
        grid(key.to(dtype)),
        grid(value.to(dtype)),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(num * length, query.shape[1], query.shape[2])


def _fresh_prompts(
    metadata: AttentionMetadata, prefill_ids: np.ndarray
) -> tuple[int, int, int] | None:
    """(first row, count, length) when every prefill sequence is a whole prompt with no earlier
    context, all of one length and adjacent in the flat batch; else None."""
    query_lens = metadata.query_lens_cpu[prefill_ids]
    if not np.array_equal(query_lens, metadata.seq_lens_cpu[prefill_ids]):
        return None
    length = int(query_lens[0])
    if not np.all(query_lens == length):
        return None
    starts = metadata.query_start_loc_cpu[prefill_ids]
    # E.g. 3 prompts of 4 tokens from row 2 -> starts [2, 6, 10]
    if not np.array_equal(starts, starts[0] + length * np.arange(prefill_ids.size)):
        return None
    return int(starts[0]), int(prefill_ids.size), length


def _plan(metadata: AttentionMetadata, device: torch.device) -> _Plan:
    query_lens = metadata.query_lens_cpu[: metadata.num_seqs]
    is_decode = query_lens == 1
    decode_ids = np.flatnonzero(is_decode)
    prefill_ids = np.flatnonzero(~is_decode)
    all_decode = prefill_ids.size == 0
    qsl = torch.arange(decode_ids.size + 1, dtype=torch.int32, device=device)
    if all_decode:
        return _Plan(True, None, None, qsl, None)
    rows = metadata.query_start_loc_cpu[decode_ids]

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

    return _Plan(
        all_decode=False,
        decode_seq_ids=to_device(decode_ids) if decode_ids.size else None,
        decode_rows=to_device(rows) if decode_ids.size else None,
        decode_query_start_loc=qsl,
        prefill_ids=prefill_ids,
        fresh=_fresh_prompts(metadata, prefill_ids),
    )
