"""Pure-decode steps with static shapes: padded to a bucket, replayed as CUDA graphs.

A CUDA graph replays a recorded sequence of kernels on the same device addresses, so every
tensor a step reads must live in a buffer allocated once, and every shape must be fixed. A step
qualifies when each scheduled sequence computes exactly one token (pure decode); prefill and
mixed steps run eagerly as before.

Buckets. A step of `n` sequences whose longest context is `m` blocks runs as the smallest
bucket `(num_seqs >= n, num_blocks >= m)`. Batch sizes are 1, 2, 4, 8, then every multiple of 8
up to `max_num_seqs` (and `max_num_seqs` itself), at most `MAX_CAPTURED_SEQS`. Block-table
widths start at `MIN_CONTEXT_TOKENS` and grow 4x up to the longest possible sequence, since the
static attention reads the bucket's whole width (see `attention/backends/padded_decode.py`).
A bucket whose gathered K/V would pass `MAX_GATHER_BYTES` is not made; steps that fit no bucket
run eagerly.

Padding. Real sequences fill rows 0..n-1 of the static inputs. A padding row has token 0 at
position 0 with seq_len 1, its whole block table and its slot_mapping pointing at the scratch
block: it writes its (finite) K/V into scratch slot 0 and attends to exactly that one key, so
its softmax is never empty and it never touches a block the block manager hands out. Real rows'
block-table entries past their own blocks also point at the scratch block (masked anyway).

Scratch block. The runner allocates one KV block more than the pool holds, with id
`num_blocks`; the block manager only knows ids below it, so no sequence ever owns it. Padding
rows may write it concurrently (several padding rows, one slot): their values are identical
and no real row reads them.

On CPU (and with `capture=False`) the same static buffers and padded attention run eagerly:
that is how tests check the padded path against the normal one without a GPU.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from qiao.attention.backends.padded_decode import PaddedDecodeBackend
from qiao.attention.metadata import AttentionMetadata
from qiao.attention.registry import get_attention_backend, resolve_backend_name
from qiao.errors import ConfigError
from qiao.layers.attention import Attention
from qiao.step import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)
ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

SMALL_BATCH_SIZES = (1, 2, 4, 8)  # then every multiple of BATCH_SIZE_STEP
BATCH_SIZE_STEP = 8
MAX_CAPTURED_SEQS = 256  # larger decode batches run eagerly
MIN_CONTEXT_TOKENS = 256  # the narrowest block table, in tokens
CONTEXT_GROWTH = 4  # each block-table width is this many times the one before
# Largest K/V gather (all layers reuse one buffer) a bucket may need: past it, eager is cheaper.
MAX_GATHER_BYTES = 512 << 20
# Per-sequence fields of the static inputs, in layout order (see StaticDecodeInputs).
_INPUT_IDS, _POSITIONS, _SLOT_MAPPING, _SEQ_LENS = range(4)
_NUM_FIELDS = 4


def resolve_cuda_graphs(setting: bool | None, device: torch.device) -> bool:
    """The `cuda_graphs` setting on `device`: None means on for CUDA, off elsewhere."""
    if setting is None:
        return device.type == "cuda"
    if setting and device.type != "cuda":
        raise ConfigError(f"cuda_graphs needs a CUDA device; this engine runs on {device}")
    return setting


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes. E.g. 40 -> [1, 2, 4, 8, 16, 24, 32, 40]; 20 -> [1, 2, 4, 8, 16, 20]."""
    limit = min(max_num_seqs, MAX_CAPTURED_SEQS)
    sizes = {s for s in SMALL_BATCH_SIZES if s <= limit}
    sizes |= set(range(2 * BATCH_SIZE_STEP, limit + 1, BATCH_SIZE_STEP)) | {limit}
    return sorted(sizes)


def context_buckets(max_num_blocks: int, block_size: int) -> list[int]:
    """Block-table widths. E.g. block_size 16, 300 blocks -> [16, 64, 256, 300]."""
    width = max(1, MIN_CONTEXT_TOKENS // block_size)
    widths = []
    while width < max_num_blocks:
        widths.append(width)
        width *= CONTEXT_GROWTH
    return [*widths, max_num_blocks]


@dataclass(frozen=True, order=True)
class DecodeBucket:
    """A padded decode shape: `num_seqs` sequences, block tables `num_blocks` wide."""

    num_seqs: int
    num_blocks: int


@dataclass(frozen=True)
class DecodeLayout:
    """What the padded decode path needs to know about the cache and the limits."""

    block_size: int
    scratch_block: int  # the runner's reserved block id (see the module docstring)
    max_num_seqs: int
    max_num_blocks: int  # the longest sequence's block count
    kv_bytes_per_token: int  # K + V of one token in one layer


def make_buckets(layout: DecodeLayout) -> list[DecodeBucket]:
    """Every bucket within MAX_GATHER_BYTES, smallest first."""
    return [
        DecodeBucket(seqs, width)
        for seqs in batch_buckets(layout.max_num_seqs)
        for width in context_buckets(layout.max_num_blocks, layout.block_size)
        if seqs * width * layout.block_size * layout.kv_bytes_per_token <= MAX_GATHER_BYTES
    ]


class StaticDecodeInputs:
    """The padded step inputs in one flat int64 device buffer, fixed for the engine's lifetime,
    and a host twin (pinned on CUDA) that each step is built in and uploaded from in one copy.

    Every bucket lays its inputs out from the start of the buffer, so a step copies only its
    bucket's `num_seqs * (4 + num_blocks)` values. E.g. bucket (2, 3):
    `[ids0 ids1 | pos0 pos1 | slot0 slot1 | len0 len1 | blocks of seq 0 (3) | of seq 1 (3)]`.
    Graphs of different buckets read the same memory in different layouts; only one step runs
    at a time, and each step rewrites its whole layout first.
    """

    def __init__(self, layout: DecodeLayout, buckets: list[DecodeBucket], device: torch.device):
        self.layout = layout
        self.device = device
        size = max((b.num_seqs * (_NUM_FIELDS + b.num_blocks) for b in buckets), default=1)
        self.buffer = torch.zeros(size, dtype=torch.int64, device=device)
        is_cuda = device.type == "cuda"
        self._host_tensor = torch.zeros(size, dtype=torch.int64, pin_memory=is_cuda)
        self.host = self._host_tensor.numpy()
        # Set after each upload: the host twin is rewritten only once its last copy is done.
        self._uploaded = torch.cuda.Event() if is_cuda else None
        self._metadata: dict[DecodeBucket, AttentionMetadata] = {}

    def fill(self, scheduled: list[ScheduledRequest], bucket: DecodeBucket) -> None:
        """Write the step (one token per sequence) into the host twin, padded to `bucket`."""
        if self._uploaded is not None and not self._uploaded.query():
            self._uploaded.synchronize()  # rare: the step that uploaded it sampled nothing
        n, width = len(scheduled), bucket.num_blocks
        bs, scratch = self.layout.block_size, self.layout.scratch_block
        fields, block_table = _split(self.host, bucket)
        block_table[:] = scratch
        num_blocks = np.fromiter((min(len(s.block_ids), width) for s in scheduled), np.int64, n)
        block_ids = itertools.chain.from_iterable(s.block_ids[:width] for s in scheduled)
        # E.g. num_blocks [2, 3] -> rows [0, 0, 1, 1, 1], cols [0, 1, 0, 1, 2]
        rows = np.repeat(np.arange(n), num_blocks)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(num_blocks) - num_blocks, num_blocks)
        block_table[rows, cols] = np.fromiter(block_ids, np.int64, rows.size)
        positions = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        fields[_INPUT_IDS, :n] = np.fromiter((s.token_ids[0] for s in scheduled), np.int64, n)
        fields[_POSITIONS, :n] = positions
        fields[_SEQ_LENS, :n] = positions + 1
        fields[_SLOT_MAPPING, :n] = block_table[np.arange(n), positions // bs] * bs + positions % bs
        # Padding rows: token 0 at position 0, one key, written to and read from scratch slot 0.
        fields[[_INPUT_IDS, _POSITIONS], n:] = 0
        fields[_SEQ_LENS, n:] = 1
        fields[_SLOT_MAPPING, n:] = scratch * bs

    def upload(self, bucket: DecodeBucket) -> None:
        size = bucket.num_seqs * (_NUM_FIELDS + bucket.num_blocks)
        self.buffer[:size].copy_(self._host_tensor[:size], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record(torch.cuda.current_stream(self.device))

    def model_inputs(
        self, bucket: DecodeBucket
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata): views of the static buffer, the same every step."""
        metadata = self._metadata.get(bucket)
        if metadata is None:
            metadata = self._metadata[bucket] = self._make_metadata(bucket)
        return _split(self.buffer, bucket)[0][_INPUT_IDS], metadata.positions, metadata

    def _make_metadata(self, bucket: DecodeBucket) -> AttentionMetadata:
        b = bucket.num_seqs
        capacity = bucket.num_blocks * self.layout.block_size
        fields, block_table = _split(self.buffer, bucket)
        return AttentionMetadata(
            num_tokens=b,
            num_seqs=b,
            block_size=self.layout.block_size,
            slot_mapping=fields[_SLOT_MAPPING],
            positions=fields[_POSITIONS],
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=self.device),
            seq_lens=fields[_SEQ_LENS],
            block_tables=block_table,
            query_start_loc_cpu=np.arange(b + 1, dtype=np.int64),
            seq_lens_cpu=np.full(b, capacity, dtype=np.int64),
            max_query_len=1,
            max_seq_len=capacity,
            is_padded_decode=True,
        )


def _split(flat: ArrayT, bucket: DecodeBucket) -> tuple[ArrayT, ArrayT]:
    """Views of a bucket's layout in `flat`: fields [4, num_seqs], block table [num_seqs, W]."""
    b, width = bucket.num_seqs, bucket.num_blocks
    fields = flat[: _NUM_FIELDS * b].reshape(_NUM_FIELDS, b)
    return fields, flat[_NUM_FIELDS * b : b * (_NUM_FIELDS + width)].reshape(b, width)


class DecodeGraphs:
    """Runs pure-decode steps through `StaticDecodeInputs`: one CUDA graph per bucket after
    `capture()`, or eagerly through the same padded path (CPU, tests)."""

    def __init__(self, model: nn.Module, layout: DecodeLayout, device: torch.device) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.buckets = make_buckets(layout)
        self.inputs = StaticDecodeInputs(layout, self.buckets, device)
        # bucket -> (graph, its output: the hidden states of every padded row)
        self.graphs: dict[DecodeBucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        install_padded_decode(model, device)

    def bucket_for(self, num_seqs: int, num_blocks: int) -> DecodeBucket | None:
        """The smallest bucket holding the step, or None."""
        fits = (b for b in self.buckets if b.num_seqs >= num_seqs and b.num_blocks >= num_blocks)
        return min(fits, default=None)

    def capture(self) -> None:
        """Record one graph per bucket, largest first so the smaller ones reuse its memory pool.

        Each bucket runs once eagerly (on a side stream, as PyTorch advises) before its capture,
        so lazy first-call work (library handles, tables moved to the device) is never
        recorded. The inputs are all padding: capture writes only the scratch block.
        """
        begin = time.perf_counter()
        with torch.inference_mode(), torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(self.device)
            for bucket in sorted(self.buckets, reverse=True):
                self.graphs[bucket] = self._capture_one(bucket, pool, side)
            torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: %d decode buckets captured in %.1f s (batch up to %d, context up to "
            "%d tokens)",
            len(self.graphs),
            time.perf_counter() - begin,
            max((b.num_seqs for b in self.graphs), default=0),
            max((b.num_blocks for b in self.graphs), default=0) * self.layout.block_size,
        )

    def _capture_one(
        self, bucket: DecodeBucket, pool: tuple[int, int], side: torch.cuda.Stream
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.inputs.fill([], bucket)
        self.inputs.upload(bucket)
        args = self.inputs.model_inputs(bucket)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.model(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self.model(*args)
        return graph, hidden

    def run(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Hidden states [num_seqs, hidden_size] of a pure-decode step, row i for sequence i;
        None when the step is not pure decode or fits no bucket (the caller runs it eagerly)."""
        scheduled = scheduler_output.scheduled
        num_seqs = len(scheduled)
        if scheduler_output.num_scheduled_tokens != num_seqs:
            return None
        max_seq_len = max(s.num_computed_tokens for s in scheduled) + 1
        bucket = self.bucket_for(num_seqs, -(-max_seq_len // self.layout.block_size))
        if bucket is None:
            return None
        self.inputs.fill(scheduled, bucket)
        self.inputs.upload(bucket)
        if self.graphs:
            graph, hidden = self.graphs[bucket]
            with torch.cuda.device(self.device):  # the engine thread may have another current
                graph.replay()
        else:
            hidden = self.model(*self.inputs.model_inputs(bucket))
        return hidden[:num_seqs]


def install_padded_decode(model: nn.Module, device: torch.device) -> None:
    """Route every attention layer's padded decode steps to the static-shape attention; other
    steps keep going to the layer's own backend."""
    for module in model.modules():
        if isinstance(module, Attention) and not isinstance(module.backend, PaddedDecodeBackend):
            inner = module.backend or get_attention_backend(
                resolve_backend_name(module.backend_name, device)
            )
            module.backend = PaddedDecodeBackend(inner)
