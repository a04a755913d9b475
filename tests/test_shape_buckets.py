"""Row buckets of the oneDNN linear paths: the matmuls only ever see a bounded set of row counts
(oneDNN caches a primitive per shape; see qiao/layers/linear_method.py), and padding changes no
result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import qiao
from qiao import LLM, SamplingParams
from qiao.layers import linear_method
from qiao.layers.linear import LinearBase
from qiao.layers.linear_method import (
    DenseMethod,
    Int8Method,
    OneDnnMethod,
    onednn_linear_available,
    row_bucket,
)

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(), reason="this torch has no oneDNN linear"
)
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_linear_available(torch.bfloat16),
    reason="oneDNN's bfloat16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT on this CPU",
)
DEMO_DIR = Path(qiao.__file__).parent / "demo_model"


def test_row_bucket_is_exact_up_to_16_then_8_sizes_per_doubling():
    assert [row_bucket(m) for m in range(17)] == list(range(17))
    assert [row_bucket(m) for m in (17, 18, 19, 31, 32, 33, 65, 100, 1025, 2000)] == [
        18,
        18,
        20,
        32,
        32,
        36,
        72,
        104,
        1152,
        2048,
    ]
    previous = 0
    for m in range(1, 5000):
        bucket = row_bucket(m)
        assert m <= bucket < m * 9 / 8 + 1, m  # never fewer rows, at most 12.5% more
        assert row_bucket(bucket) == bucket  # a bucket is its own bucket
        assert bucket >= previous  # monotonic
        previous = bucket
    for power in range(5, 14):
        assert row_bucket(2**power) == 2**power
    # The default token budget (2048) needs 72 sizes: 16 exact ones, then 8 in each doubling.
    assert len({row_bucket(m) for m in range(1, 2049)}) == 72


def _layer(n: int, k: int, bias: bool, dtype: torch.dtype) -> LinearBase:
    torch.manual_seed(0)
    layer = LinearBase(k, n, bias=bias)
    layer.weight.data = torch.randn(n, k).to(dtype)
    if bias:
        layer.bias.data = torch.randn(n).to(dtype)
    return layer


class _RowSpy:
    """Wraps an op and records the row count of its first argument."""

    def __init__(self, op):
        self.op = op
        self.rows: list[int] = []

    def __call__(self, x, *args, **kwargs):
        self.rows.append(x.shape[0])
        return self.op(x, *args, **kwargs)


ROWS = [0, 1, 16, 17, 33, 100, 300]


@needs_onednn
@pytest.mark.parametrize(
    "dtype", [pytest.param(torch.bfloat16, marks=needs_onednn_bf16), torch.float32]
)
def test_onednn_method_runs_bucketed_rows_and_returns_the_same_result(monkeypatch, dtype):
    layer = _layer(96, 80, bias=True, dtype=dtype)
    dense = layer.weight.detach().clone()
    layer.method = OneDnnMethod(batch_hint=64)
    layer.method.prepare(layer)
    spy = _RowSpy(torch.ops.mkldnn._linear_pointwise)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for rows in ROWS:
        x = torch.randn(rows, 80).to(dtype)
        monkeypatch.setattr(linear_method, "ROW_BUCKETS", False)
        exact = layer(x)
        monkeypatch.setattr(linear_method, "ROW_BUCKETS", True)
        out = layer(x)
        assert out.shape == (rows, 96)
        assert torch.equal(out, exact), rows  # each row's result is its own
        expected = F.linear(x.float(), dense.float(), layer.bias.float()).to(dtype)
        torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)
    assert spy.rows == [r for rows in ROWS for r in (rows, row_bucket(rows))]
    # Leading dimensions are kept, as F.linear keeps them; the matmul sees 2 * 17 -> 36 rows.
    spy.rows.clear()
    x3 = torch.randn(2, 17, 80).to(dtype)
    out3 = layer(x3)
    assert out3.shape == (2, 17, 96)
    assert spy.rows == [36]
    torch.testing.assert_close(out3, layer(x3.reshape(34, 80)).reshape(2, 17, 96))


@needs_onednn_bf16
def test_int8_method_buckets_its_onednn_rows(monkeypatch):
    layer = _layer(64, 48, bias=True, dtype=torch.float32)
    layer.method = Int8Method()
    layer.method.prepare(layer)
    spy = _RowSpy(torch.ops.mkldnn._linear_pointwise)
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    x = torch.randn(37, 48)
    out = layer(x)
    assert spy.rows == [40]
    monkeypatch.setattr(linear_method, "ROW_BUCKETS", False)
    assert torch.equal(out, layer(x))
    assert spy.rows == [40, 37]


def test_dense_method_buckets_cpu_bfloat16_only(monkeypatch):
    spy = _RowSpy(F.linear)
    monkeypatch.setattr(F, "linear", spy)
    layer = _layer(32, 24, bias=False, dtype=torch.bfloat16)
    layer.method = DenseMethod()
    x = torch.randn(21, 24)
    out = layer(x.bfloat16())
    assert out.shape == (21, 32)
    assert spy.rows == [22]  # bfloat16 F.linear on the CPU is oneDNN's matmul
    layer32 = _layer(32, 24, bias=False, dtype=torch.float32)
    layer32.method = DenseMethod()
    layer32(x)
    assert spy.rows == [22, 21]  # float32 is MKL's: left as it is


def test_demo_model_generates_the_same_tokens_with_and_without_buckets(monkeypatch):
    # Prompts of different lengths make steps of 17-200 tokens: most of them padded.
    prompts = [
        {"prompt_token_ids": [3 + (i * 7 + j) % 4000 for j in range(n)]}
        for i, n in enumerate((5, 17, 29, 43, 61, 90))
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # No prefix caching: the second run computes every prompt again.
    llm = LLM(
        str(DEMO_DIR),
        dtype="bfloat16",
        num_threads=1,
        profile=None,
        enable_prefix_caching=False,
    )
    monkeypatch.setattr(linear_method, "ROW_BUCKETS", False)
    exact = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(linear_method, "ROW_BUCKETS", True)
    bucketed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert bucketed == exact


def test_bucket_sizes_cover_every_row_count():
    sizes = linear_method.bucket_sizes(2048)
    assert len(sizes) == 72 and sizes[:16] == list(range(1, 17)) and sizes[-1] == 2048
    assert {row_bucket(m) for m in range(1, 2049)} == set(sizes)


_PROBE = """
import random, sys
from qiao import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_num_batched_tokens=256, num_threads=1)
if sys.argv[2] == "warm":
    llm.engine.warm_row_buckets()
print("=== LOAD ===", flush=True)
rng = random.Random(0)
prompts = [[rng.randrange(100, 1000) for _ in range(rng.randrange(1, 120))] for _ in range(40)]
llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
print("=== END ===", flush=True)
"""


def _primitives_built_under_load(warm: str) -> int:
    """oneDNN's own count (ONEDNN_VERBOSE) of matmul primitives it had to build while 40
    prompts of 1-119 tokens ran, after the engine was built (and warmed, or not)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(DEMO_DIR), warm],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    under_load = out.split("=== LOAD ===", 1)[1].split("=== END ===", 1)[0]
    return sum("create:cache_miss" in line for line in under_load.splitlines())


@needs_onednn_bf16
def test_warmed_engine_builds_no_matmul_primitive_under_load():
    """`warm_row_buckets` (the server's engine processes call it) builds every primitive up
    front, so memory stays flat under load; without it new step sizes keep building them."""
    assert _primitives_built_under_load("cold") > 0
    assert _primitives_built_under_load("warm") == 0
