"""The reference paged-attention backend against a naive per-sequence, per-token oracle."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_attn_metadata

from qiao.attention.registry import get_attention_backend
from qiao.errors import ConfigError

BLOCK_SIZE = 4
HEAD_DIM = 8


def naive_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int | None
) -> torch.Tensor:
    """query [Q, H, D] at the last Q of the L positions of key/value [L, Hkv, D], in float64."""
    num_queries, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = key.shape
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(num_queries):
        position = context_len - num_queries + i
        visible = [j for j in range(position + 1) if window is None or j > position - window]
        for h in range(num_heads):
            kv_head = h // (num_heads // num_kv_heads)
            q = query[i, h].double()
            scale = query.shape[-1] ** -0.5
            scores = torch.stack([q @ key[j, kv_head].double() * scale for j in visible])
            weights = torch.softmax(scores, dim=0)
            for weight, j in zip(weights, visible, strict=True):
                out[i, h] += weight * value[j, kv_head].double()
    return out


class Batch:
    """One step: per sequence its true K/V at every position and its queries; earlier
    positions already sit in a NaN-initialised paged cache."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        num_heads: int,
        num_kv_heads: int,
        num_blocks: int = 64,
        block_size: int = BLOCK_SIZE,
        head_dim: int = HEAD_DIM,
        cache_dtype: torch.dtype = torch.float32,
    ):
        generator = torch.Generator().manual_seed(0)
        self.cache_dtype = cache_dtype
        self.block_size, self.head_dim = block_size, head_dim
        free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(free_blocks)
        self.shapes = shapes
        self.keys, self.values, self.queries, self.block_tables = [], [], [], []
        for seq_len, query_len in shapes:
            kv_shape = (seq_len, num_kv_heads, head_dim)
            self.keys.append(torch.randn(kv_shape, generator=generator))
            self.values.append(torch.randn(kv_shape, generator=generator))
            self.queries.append(torch.randn(query_len, num_heads, head_dim, generator=generator))
            num_seq_blocks = -(-seq_len // block_size)
            self.block_tables.append([free_blocks.pop() for _ in range(num_seq_blocks)])
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.full(shape, float("nan"))
        for i, (seq_len, query_len) in enumerate(shapes):
            for position in range(seq_len - query_len):
                self.write(i, position)
        self.kv_cache = self.kv_cache.to(cache_dtype)

    def write(self, seq: int, position: int) -> None:
        block = self.block_tables[seq][position // self.block_size]
        self.kv_cache[0, block, position % self.block_size] = self.keys[seq][position]
        self.kv_cache[1, block, position % self.block_size] = self.values[seq][position]

    def run(self, window: int | None, backend: str = "torch") -> torch.Tensor:
        query_lens = [q for _, q in self.shapes]
        seq_lens = [s for s, _ in self.shapes]
        metadata = build_attn_metadata(query_lens, seq_lens, self.block_tables, self.block_size)
        new_keys = torch.cat([k[s - q :] for k, (s, q) in zip(self.keys, self.shapes, strict=True)])
        new_values = torch.cat(
            [v[s - q :] for v, (s, q) in zip(self.values, self.shapes, strict=True)]
        )
        return get_attention_backend(backend).forward(
            torch.cat(self.queries),
            new_keys,
            new_values,
            self.kv_cache,
            metadata,
            scale=self.head_dim**-0.5,
            num_kv_heads=new_keys.shape[1],
            sliding_window=window,
        )

    def expected(self, window: int | None) -> torch.Tensor:
        """The oracle over K/V as the cache stores them (rounded to its dtype)."""

        def stored(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.cache_dtype).float()

        return torch.cat(
            [
                naive_attention(q, stored(k), stored(v), window)
                for q, k, v in zip(self.queries, self.keys, self.values, strict=True)
            ]
        )


# (seq_len, query_len): decodes and prefill chunks interleaved, crossing block boundaries.
MIXED = [(1, 1), (9, 1), (13, 5), (8, 8), (30, 1), (17, 17), (21, 3), (4, 1)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 5, 20])
def test_matches_naive_attention(num_heads, num_kv_heads, window):
    batch = Batch(MIXED, num_heads, num_kv_heads)
    out = batch.run(window)
    assert out.shape == (sum(q for _, q in MIXED), num_heads, HEAD_DIM)
    torch.testing.assert_close(out.double(), batch.expected(window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shapes", [[(5, 1), (12, 1), (1, 1)], [(6, 6), (19, 4)]])
def test_decode_only_and_prefill_only_batches(shapes):
    batch = Batch(shapes, num_heads=4, num_kv_heads=2)
    torch.testing.assert_close(batch.run(None).double(), batch.expected(None), atol=1e-5, rtol=0)


def test_writes_new_kv_to_slot_mapping():
    batch = Batch(MIXED, num_heads=4, num_kv_heads=2)
    batch.run(None)
    written = batch.kv_cache.clone()
    for i, (seq_len, _) in enumerate(MIXED):
        for position in range(seq_len):
            batch.write(i, position)
    assert torch.equal(written.nan_to_num(7.0), batch.kv_cache.nan_to_num(7.0))


@pytest.mark.parametrize("reader", [(6, 2), (5, 1)])
def test_sequence_reads_block_another_sequence_writes_in_the_same_step(reader):
    # The reader shares sequence 0's first block (same 4-token prefix) and computes only its
    # tokens from position 4 (a prefill chunk, or a decode); sequence 0 writes that block in
    # this very step.
    batch = Batch([(8, 8), reader], num_heads=4, num_kv_heads=2)
    batch.keys[1][:BLOCK_SIZE] = batch.keys[0][:BLOCK_SIZE]
    batch.values[1][:BLOCK_SIZE] = batch.values[0][:BLOCK_SIZE]
    batch.block_tables[1][0] = batch.block_tables[0][0]
    batch.kv_cache.fill_(float("nan"))
    out = batch.run(None)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), batch.expected(None), atol=1e-5, rtol=1e-5)


def test_unknown_backend_names_the_setting():
    with pytest.raises(ConfigError, match=r"attention_backend.*'nope'.*torch"):
        get_attention_backend("nope")
