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


DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


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
