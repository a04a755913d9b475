"""The C++ CPU kernels against their plain-PyTorch references (the oracle)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from test_attention_ref import MIXED, Batch

from qiao.kernels import cpu_ops
from qiao.layers.layernorm import RMSNorm
from qiao.layers.rotary import RotaryEmbedding, apply_rotary

ops = cpu_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="C++ CPU kernels could not be built here")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_kernels_build_where_a_compiler_exists():
    # Without this, a broken kernel source would only show up as skipped tests.
    assert ops is not None, "qiao/kernels failed to build; run with logging to see the error"


DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]


@needs_ops
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 1, 5, 20])
def test_paged_attention_matches_naive(num_heads, num_kv_heads, window):
    batch = Batch(MIXED, num_heads, num_kv_heads)
    out = batch.run(window, backend="cpu")
    torch.testing.assert_close(out.double(), batch.expected(window), atol=1e-5, rtol=1e-5)


@needs_ops
def test_paged_attention_long_contexts_match_reference():
    shapes = [(300, 1), (77, 1), (260, 40), (129, 129), (1, 1)]
    cpu = Batch(shapes, num_heads=9, num_kv_heads=3, num_blocks=256)
    ref = Batch(shapes, num_heads=9, num_kv_heads=3, num_blocks=256)
    torch.testing.assert_close(cpu.run(None, "cpu"), ref.run(None, "torch"), atol=2e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm_and_fused_add(dtype, tol):
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    norm = norm.to(dtype)
    x = torch.randn(37, 96, dtype=dtype)
    residual = torch.randn(37, 96, dtype=dtype)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), atol=tol, rtol=tol)
    expected_residual = residual + x
    expected = norm(expected_residual)
    x2, r2 = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x2, r2, norm.weight, 1e-5)
    torch.testing.assert_close(r2, expected_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(x2, expected, atol=tol, rtol=tol)


@needs_ops
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rotary_in_place(dtype, tol):
    rope = RotaryEmbedding(64, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 300, 1023, 2])
    cos, sin = rope(positions, dtype)
    qkv = torch.randn(6, 5 * 64, dtype=dtype)
    q = qkv[:, : 3 * 64].view(6, 3, 64)  # a strided view, as the model passes it
    expected = apply_rotary(q.clone(), cos, sin)
    ops.rotary_(q, cos, sin)
    torch.testing.assert_close(q, expected, atol=tol, rtol=tol)


@needs_ops
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(cache_dtype):
    from qiao.attention.backends.torch_ref import write_kv

    # k and v as the model passes them: strided views of one fused qkv output.
    qkv = torch.randn(9, (4 + 2 + 2) * 16)
    k = qkv[:, 64:96].view(9, 2, 16)
    v = qkv[:, 96:].view(9, 2, 16)
    slots = torch.tensor([0, 5, 17, 31, 2, 40, 63, 8, 33])
    expected = torch.zeros(2, 4, 16, 2, 16, dtype=cache_dtype)
    write_kv(expected, k, v, slots)
    cache = torch.zeros_like(expected)
    ops.write_kv(cache, k, v, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)
    # A negative slot (a padding row) is skipped; a slot past the cache is an error, not a write.
    before = cache.clone()
    ops.write_kv(cache, k[:1] + 1, v[:1] + 1, torch.tensor([-1]))
    torch.testing.assert_close(cache, before, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="past the cache"):
        ops.write_kv(cache, k[:1], v[:1], torch.tensor([64]))


@needs_ops
@pytest.mark.parametrize("shapes", [MIXED, [(12, 12), (12, 12), (30, 1)], [(40, 1), (17, 1)]])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_vectorized_backend_runs_every_row_through_the_kernel(shapes, window):
    # Head size 64 and block size 16 take the AVX-512 kernel for decode tokens and prompt chunks
    # alike (one call per layer); the oracle is the naive per-token attention.
    batch = Batch(shapes, num_heads=6, num_kv_heads=2, block_size=16, head_dim=64)
    if not ops.attention_vectorized(batch.kv_cache):
        pytest.skip("no AVX-512 kernel on this CPU")
    out = batch.run(window, backend="cpu")
    torch.testing.assert_close(out.double(), batch.expected(window), atol=1e-5, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (8, 4)])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_16_bit_cache_under_float32_queries(cache_dtype, head_dim, block_size, backend):
    # A 16-bit KV cache with float32 weights: the output stays float32, against the
    # oracle over the K/V the cache holds. Head size 64 / block 16 reads every row through the
    # AVX-512 kernel in float32 (exact to float32); head size 8 / block 4 takes the scalar kernel
    # for decodes (it computes in the cache's dtype) and SDPA for prompts (over the step's own
    # float32 K/V), so a 16-bit tolerance.
    batch = Batch(MIXED, 6, 2, block_size=block_size, head_dim=head_dim, cache_dtype=cache_dtype)
    exact = backend == "torch" or ops.attention_vectorized(batch.kv_cache)
    out = batch.run(None, backend)
    assert out.dtype == torch.float32 and batch.kv_cache.dtype == cache_dtype
    tol = 2e-5 if exact else 2e-2
    torch.testing.assert_close(out.double(), batch.expected(None), atol=tol, rtol=tol)


def test_attention_vectorized_names_the_supported_caches():
    if ops is None or not ops.attention_vectorized(torch.zeros(2, 1, 16, 1, 64)):
        pytest.skip("no AVX-512 kernel on this CPU")
    assert ops.attention_vectorized(torch.zeros(2, 1, 32, 2, 128, dtype=torch.bfloat16))
    assert not ops.attention_vectorized(torch.zeros(2, 1, 8, 1, 64))  # block size
    assert not ops.attention_vectorized(torch.zeros(2, 1, 16, 1, 8))  # head size
    assert ops.attention_vectorized(torch.zeros(2, 1, 16, 1, 64, dtype=torch.float16))


FRESH = [(9, 1), (12, 12), (12, 12), (12, 12), (30, 1)]


@needs_ops
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("window", [None, 5, 20])
def test_fresh_prompts_of_one_length_match_naive(num_heads, num_kv_heads, window):
    # Three whole prompts of 12 tokens between decode tokens: the causal fast path (with the
    # 5-token window, the gathered path: the window cuts inside the prompts).
    batch = Batch(FRESH, num_heads, num_kv_heads)
    out = batch.run(window, backend="cpu")
    torch.testing.assert_close(out.double(), batch.expected(window), atol=1e-5, rtol=1e-5)


def test_fresh_prompt_detection(make_attn_metadata):
    from qiao.attention.backends.cpu_paged import _fresh_prompts

    def fresh(shapes):
        query_lens, seq_lens = [q for _, q in shapes], [s for s, _ in shapes]
        tables = torch.arange(len(shapes) * 4).view(len(shapes), 4)
        metadata = make_attn_metadata(query_lens, seq_lens, tables, 16)
        prefill = np.flatnonzero(metadata.query_lens_cpu[: len(shapes)] > 1)
        return _fresh_prompts(metadata, prefill)

    assert fresh(FRESH) == (1, 3, 12)
    assert fresh([(12, 12)]) == (0, 1, 12)
    assert fresh([(12, 12), (9, 9)]) is None  # two lengths
    assert fresh([(20, 12), (12, 12)]) is None  # earlier context (a cached prefix or a chunk)
    assert fresh([(12, 12), (3, 1), (12, 12)]) is None  # not adjacent


def _kernel_reference(q, kv_cache, block_tables, query_lens, seq_lens, scale, window):
    """Naive float64 attention of each sequence's new tokens over its context, read through
    its block table: the oracle for calling the kernel directly."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for s, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(seq_len)
        blocks = block_tables[s, positions // block_size].long()
        keys = kv_cache[0, blocks, positions % block_size].double()  # [L, Hkv, D]
        values = kv_cache[1, blocks, positions % block_size].double()
        for j in range(query_len):
            pos = seq_len - query_len + j
            visible = (positions <= pos) & (
                positions > pos - window if window else torch.ones_like(positions, dtype=bool)
            )
            for h in range(q.shape[1]):
                scores = keys[visible, h // group] @ q[row, h].double() * scale
                out[row, h] = torch.softmax(scores, 0) @ values[visible, h // group]
            row += 1
    return out


def _kernel_case(cache_dtype, query_dtype, head_dim, block_size):
    """A batch of decodes, multi-token chunks longer than a query tile and contexts that end
    mid-group over a shuffled block table, the cache NaN outside the written slots, 3 query
    heads per kv head: (q, kv_cache, tables, query_start_loc, query_lens, seq_lens)."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, num_blocks = 6, 2, 40
    shapes = [(1, 1), (17, 1), (100, 1), (45, 20), (33, 33), (64, 3)]  # (seq_len, query_len)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    free = torch.randperm(num_blocks).tolist()
    max_blocks = max(-(-seq // block_size) for seq, _ in shapes)
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    for s, (seq_len, _) in enumerate(shapes):
        for b in range(-(-seq_len // block_size)):
            tables[s, b] = free.pop()
        positions = torch.arange(seq_len)
        blocks = tables[s, positions // block_size].long()
        kv_cache[:, blocks, positions % block_size] = torch.randn(
            2, seq_len, num_kv_heads, head_dim
        )
    query_lens = [q for _, q in shapes]
    seq_lens = [s for s, _ in shapes]
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(query_dtype)
    qsl = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    return q, kv_cache.to(cache_dtype), tables, qsl, query_lens, seq_lens


@needs_ops
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (32, 16), (64, 48)])
@pytest.mark.parametrize("window", [0, 7, 40])
def test_paged_attention_kernel_vector_path(dtype, tol, head_dim, block_size, window):
    # Head and block sizes that take the AVX-512 path where there is one (and the scalar path
    # elsewhere).
    q, kv_cache, tables, qsl, query_lens, seq_lens = _kernel_case(
        dtype, dtype, head_dim, block_size
    )
    scale = head_dim**-0.5
    out = ops.paged_attention(
        q, kv_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), scale, window
    )
    expected = _kernel_reference(
        q.float(), kv_cache.float(), tables, query_lens, seq_lens, scale, window
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@needs_ops
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
@pytest.mark.parametrize("window", [0, 7])
def test_float32_query_over_16_bit_cache(cache_dtype, head_dim, block_size, window):
    # kv_cache_dtype="bfloat16" / "float16" under float32 weights: the kernel reads the 16-bit
    # cache and computes in float32, so against the same 16-bit values in float64 it is
    # float32-exact (the query is not rounded).
    q, kv_cache, tables, qsl, query_lens, seq_lens = _kernel_case(
        cache_dtype, torch.float32, head_dim, block_size
    )
    if not ops.attention_vectorized(kv_cache):
        pytest.skip("no AVX-512 kernel on this CPU")
    scale = head_dim**-0.5
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    out = ops.paged_attention(q, kv_cache, tables, qsl, sl, scale, window)
    assert out.dtype == torch.float32
    expected = _kernel_reference(q, kv_cache.float(), tables, query_lens, seq_lens, scale, window)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    # The scalar kernel (block size 8) takes one dtype: the error says so.
    q8, cache8, tables8, qsl8, _, _ = _kernel_case(cache_dtype, torch.float32, 64, 8)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_attention(q8, cache8, tables8, qsl8, sl, scale, window)


@needs_ops
@pytest.mark.parametrize("window", [None, 5])
def test_invariant_backend_runs_prompt_chunks_through_the_scalar_kernel_too(window):
    # Head size 8 / block 4 has no AVX-512 form: the plain backend sends prompt chunks to SDPA,
    # the batch-invariant one sends every row through the scalar paged kernel; both against the
    # naive per-token oracle.
    batch = Batch(MIXED, 6, 2, block_size=4, head_dim=8)
    assert not ops.attention_vectorized(batch.kv_cache)
    out = batch.run(window, backend="cpu_invariant")
    torch.testing.assert_close(out.double(), batch.expected(window), atol=1e-5, rtol=1e-5)


# Widths around the kernels' 16-lane steps (remainders 0, 1, 7, 15) and the Qwen2.5-0.5B MLP's.
GATE_WIDTHS = [1, 7, 16, 17, 31, 4864]


@needs_ops
@pytest.mark.parametrize("width", GATE_WIDTHS)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_silu_and_mul_matches_pytorch(width, lead):
    from qiao.layers.activation import SiluAndMul

    x = torch.randn(*lead, 2 * width, generator=torch.Generator().manual_seed(width)) * 6
    edges = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-30])  # saturated, zero and tiny gates
    x[..., : min(width, 5)] = edges[: min(width, 5)]
    gate, up = x.chunk(2, dim=-1)
    # float32: the kernel's exp differs from PyTorch's in the last bits only.
    out = ops.silu_and_mul(x)
    assert out.shape == (*lead, width)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=1e-5, rtol=1e-5)
    # bfloat16: silu rounded to bfloat16, then the product, as PyTorch: the same bits.
    xb = x.bfloat16()
    gb, ub = xb.chunk(2, dim=-1)
    assert torch.equal(ops.silu_and_mul(xb), torch.nn.functional.silu(gb) * ub)
    assert torch.equal(SiluAndMul()(xb), torch.nn.functional.silu(gb) * ub)


@needs_ops
def test_silu_and_mul_keeps_nan_and_infinities():
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 2.0, 1.0, 1.0, 1.0, 3.0]])
    expected = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
    torch.testing.assert_close(ops.silu_and_mul(x), expected, equal_nan=True)


@needs_ops
def test_silu_and_mul_refuses_odd_widths_and_other_dtypes():
    with pytest.raises(RuntimeError, match="2 \\* d"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(torch.randn(2, 4).half())


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 1000, 151936])
def test_argmax_rows_matches_torch(dtype, width):
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(6, width, generator=g).to(dtype)
    if width > 2:
        logits[1, width // 2] = logits[1, 1] = logits[1].max() + 1  # a tie: the first one wins
        logits[2] = float("-inf")  # every token banned: index 0, as torch
        logits[3, width - 1] = float("inf")
        logits[4, width // 3] = logits[4, width - 2] = float("nan")  # the first NaN wins
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    # Rows of a wider matrix (a strided view, contiguous within each row).
    wide = torch.randn(3, width + 5, generator=g).to(dtype)[:, 2 : width + 2]
    assert torch.equal(ops.argmax_rows(wide), wide.argmax(dim=-1))


@needs_ops
def test_greedy_tokens_take_the_kernel_and_fall_back_elsewhere():
    from qiao.runner.sampler import greedy_tokens

    logits = torch.randn(4, 300)
    for t in (logits, logits.bfloat16(), logits.half(), logits.t().contiguous().t()):
        assert torch.equal(greedy_tokens(t), t.argmax(dim=-1))
