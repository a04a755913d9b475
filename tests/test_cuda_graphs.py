"""The static-shape decode path behind CUDA graphs: buckets, padded attention, and end to end.

On CPU the padded path runs eagerly (`ModelRunner.enable_padded_decode(capture=False)`) and must
give the normal path's greedy tokens and logits. The `gpu` tests compare graph replay with eager
execution on CUDA and run the benchmarks there; they skip without CUDA.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from qiao import LLM, SamplingParams
from qiao.attention.backends.padded_decode import PaddedDecodeBackend, padded_decode_attention
from qiao.attention.backends.torch_ref import TorchRefBackend
from qiao.errors import ConfigError
from qiao.runner import cuda_graphs
from qiao.runner.cuda_graphs import (
    DecodeBucket,
    DecodeLayout,
    StaticDecodeInputs,
    batch_buckets,
    context_buckets,
    make_buckets,
    resolve_cuda_graphs,
)
from qiao.step import ScheduledRequest

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BLOCK_SIZE = 8
# Prompt lengths: 5 prompts (not a bucket size), contexts from 1 to 7 blocks of 8 tokens.
PROMPT_LENS = (3, 17, 9, 30, 1)
MAX_TOKENS = 24


# --- buckets ----------------------------------------------------------------------------------


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(1000)[-1] == cuda_graphs.MAX_CAPTURED_SEQS


def test_context_buckets() -> None:
    assert context_buckets(300, 16) == [16, 64, 256, 300]
    assert context_buckets(16, 16) == [16]
    assert context_buckets(3, 16) == [3]
    assert context_buckets(40, 8) == [32, 40]


def test_buckets_stay_within_the_gather_budget() -> None:
    # 1 MiB per token per layer: 512 tokens of context in all fit the budget.
    layout = DecodeLayout(16, 99, 8, 64, kv_bytes_per_token=1 << 20)
    buckets = make_buckets(layout)
    assert DecodeBucket(2, 16) in buckets and DecodeBucket(4, 16) not in buckets
    assert all(b.num_seqs * b.num_blocks * 16 <= 512 for b in buckets)


def test_cuda_graphs_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_cuda_graphs(None, cpu) is False
    assert resolve_cuda_graphs(None, cuda) is True
    assert resolve_cuda_graphs(False, cuda) is False
    with pytest.raises(ConfigError, match="cuda_graphs"):
        resolve_cuda_graphs(True, cpu)


def test_cuda_graphs_on_cpu_is_a_config_error(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        LLM(str(tiny_checkpoint("llama")), device="cpu", cuda_graphs=True)


def test_serve_and_bench_flags() -> None:
    import argparse

    from qiao.api.settings import load_settings
    from qiao.bench.cli import add_bench_subcommands
    from qiao.settings_schema import resolve_engine_flags

    assert load_settings([]).cuda_graphs_choice is None
    assert load_settings(["--cuda-graphs"]).cuda_graphs_choice is True
    assert load_settings(["--no-cuda-graphs"]).cuda_graphs_choice is False
    with pytest.raises(ConfigError, match="exclude each other"):
        load_settings(["--cuda-graphs", "--no-cuda-graphs"])
    bench = argparse.ArgumentParser()
    add_bench_subcommands(bench)

    def parse(argv: list[str]) -> argparse.Namespace:
        args = bench.parse_args(argv)
        resolve_engine_flags(args, environ={})
        return args

    args = parse(["latency", "--shape", "tiny", "--device", "cpu", "--no-cuda-graphs"])
    assert (args.device, args.cuda_graphs) == ("cpu", False)
    assert parse(["throughput", "--shape", "tiny"]).cuda_graphs is None


# --- static inputs and padded attention ---------------------------------------------------------


def _scheduled(seq_lens: list[int], block_tables: list[list[int]]) -> list[ScheduledRequest]:
    """Decode entries: sequence i computes its token at position seq_lens[i] - 1."""
    return [
        ScheduledRequest(None, [100 + i], n - 1, table, sample=True)
        for i, (n, table) in enumerate(zip(seq_lens, block_tables, strict=True))
    ]


def test_static_inputs_pad_to_the_scratch_block() -> None:
    layout = DecodeLayout(
        4, scratch_block=9, max_num_seqs=4, max_num_blocks=3, kv_bytes_per_token=1
    )
    bucket = DecodeBucket(4, 3)
    inputs = StaticDecodeInputs(layout, [DecodeBucket(1, 3), bucket], torch.device("cpu"))
    inputs.fill(_scheduled([6, 1], [[3, 5], [7]]), bucket)
    inputs.upload(bucket)
    input_ids, positions, metadata = inputs.model_inputs(bucket)
    assert input_ids.tolist() == [100, 101, 0, 0]
    assert positions.tolist() == [5, 0, 0, 0]
    assert metadata.seq_lens.tolist() == [6, 1, 1, 1]
    # Position 5 is slot 1 of block 5; padding writes scratch slot 0 (block 9).
    assert metadata.slot_mapping.tolist() == [21, 28, 36, 36]
    assert metadata.block_tables.tolist() == [[3, 5, 9], [7, 9, 9], [9, 9, 9], [9, 9, 9]]
    assert metadata.is_padded_decode and metadata.num_seqs == 4
    # A smaller step reuses the buffers; stale rows are padding again.
    inputs.fill(_scheduled([2], [[4]]), bucket)
    inputs.upload(bucket)
    assert metadata.block_tables.tolist()[1] == [9, 9, 9]
    assert input_ids.tolist() == [100, 0, 0, 0]
    # Another bucket lays its inputs over the same memory.
    small = DecodeBucket(1, 3)
    inputs.fill(_scheduled([9], [[1, 2, 3]]), small)
    inputs.upload(small)
    small_ids, _, small_metadata = inputs.model_inputs(small)
    assert small_ids.tolist() == [100] and small_metadata.block_tables.tolist() == [[1, 2, 3]]
    assert small_metadata.slot_mapping.tolist() == [3 * 4]


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_padded_decode_matches_reference_and_writes_only_its_slots(
    make_attn_metadata: Callable, sliding_window: int | None
) -> None:
    """Real rows equal the reference backend; padding rows touch only the scratch block."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, heads, kv_heads, dim, bs = 12, 4, 2, 16, 4
    scratch = num_blocks - 1
    seq_lens = [1, 7, 12, 5]  # up to 3 blocks
    tables = [[2], [0, 6], [1, 4, 8], [3, 10]]
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    key = torch.randn(len(seq_lens), kv_heads, dim, generator=gen)
    value = torch.randn(len(seq_lens), kv_heads, dim, generator=gen)

    ref_cache = cache.clone()
    metadata = make_attn_metadata([1] * len(seq_lens), seq_lens, tables, bs)
    expected = TorchRefBackend().forward(
        query,
        key,
        value,
        ref_cache,
        metadata,
        scale=0.3,
        num_kv_heads=2,
        sliding_window=sliding_window,
    )

    layout = DecodeLayout(bs, scratch, max_num_seqs=6, max_num_blocks=4, kv_bytes_per_token=1)
    bucket = DecodeBucket(6, 4)
    inputs = StaticDecodeInputs(layout, [bucket], torch.device("cpu"))
    inputs.fill(_scheduled(seq_lens, tables), bucket)
    inputs.upload(bucket)
    _, _, padded = inputs.model_inputs(bucket)
    padding = torch.zeros(2, kv_heads, dim)
    got_cache = cache.clone()
    got = PaddedDecodeBackend(TorchRefBackend()).forward(
        torch.cat([query, torch.zeros(2, heads, dim)]),
        torch.cat([key, padding]),
        torch.cat([value, padding]),
        got_cache,
        padded,
        scale=0.3,
        num_kv_heads=2,
        sliding_window=sliding_window,
    )
    torch.testing.assert_close(got[: len(seq_lens)], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got_cache[:, :scratch], ref_cache[:, :scratch], atol=0, rtol=0)


def test_padded_decode_ignores_nan_past_each_sequence() -> None:
    cache = torch.zeros(2, 3, 4, 1, 8)
    cache[:, 1, 2:] = float("nan")  # past the end of the sequence owning block 1
    query = torch.ones(2, 2, 8)
    out = padded_decode_attention(
        query, cache, torch.tensor([[0, 1], [2, 2]]), torch.tensor([6, 1]), 1.0, None
    )
    assert torch.isfinite(out).all()


# --- end to end on CPU --------------------------------------------------------------------------


class _LogitsRecorder:
    """Wraps a model's compute_logits; keeps every step's logits on the host."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.steps: list[torch.Tensor] = []
        self._inner = model.compute_logits
        model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._inner(hidden)
        self.steps.append(logits.float().cpu())
        return logits


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], _LogitsRecorder]:
    recorder = _LogitsRecorder(llm.engine.runner.model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], recorder


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 300, n).tolist() for n in PROMPT_LENS]


def _count_padded_steps(llm: LLM) -> list[int]:
    """Wrap the runner's padded path; the list grows by the batch size of each step it ran."""
    graphs = llm.engine.runner.decode_graphs
    counts: list[int] = []
    run = graphs.run

    def counting(scheduler_output):
        hidden = run(scheduler_output)
        if hidden is not None:
            counts.append(hidden.shape[0])
        return hidden

    graphs.run = counting
    return counts


def _assert_same_steps(a: _LogitsRecorder, b: _LogitsRecorder, atol: float) -> None:
    assert len(a.steps) == len(b.steps)
    for step, (x, y) in enumerate(zip(a.steps, b.steps, strict=True)):
        torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_padded_decode_gives_the_same_tokens_and_logits_on_cpu(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """mistral has a sliding window (24) that long sequences pass; qwen3 has q/k norms. Small
    context buckets (8, 32, 128 tokens, ...) make the batch move between buckets."""
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT_TOKENS", 8)
    path = str(tiny_checkpoint(arch))
    kwargs = dict(device="cpu", block_size=BLOCK_SIZE, max_num_seqs=8, enable_prefix_caching=False)
    prompts = _prompts()
    normal_tokens, normal_logits = _generate(LLM(path, **kwargs), prompts)

    llm = LLM(path, **kwargs)
    llm.engine.runner.enable_padded_decode(capture=False)
    padded_steps = _count_padded_steps(llm)
    padded_tokens, padded_logits = _generate(llm, prompts)

    assert padded_tokens == normal_tokens
    _assert_same_steps(padded_logits, normal_logits, atol=1e-5)
    # Most steps decoded through the padded path, at batch sizes that are not buckets.
    assert len(padded_steps) >= MAX_TOKENS - 2 and 5 in padded_steps
    assert len({t for seq in normal_tokens for t in seq}) > 5, "degenerate model"


def test_padded_decode_with_preemption_and_mixed_steps(tiny_checkpoint) -> None:
    """A pool too small for every sequence: preemption and recompute mix prefill into decode."""
    path = str(tiny_checkpoint("llama"))
    kwargs = dict(device="cpu", block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=8)
    prompts = _prompts() * 2
    normal_tokens, _ = _generate(LLM(path, **kwargs), prompts)
    llm = LLM(path, **kwargs)
    llm.engine.runner.enable_padded_decode(capture=False)
    padded_tokens, _ = _generate(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert padded_tokens == normal_tokens


# --- on CUDA --------------------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_graph_replay_matches_eager_on_cuda(tiny_checkpoint, arch: str) -> None:
    path = str(tiny_checkpoint(arch))
    kwargs = dict(device="cuda", block_size=BLOCK_SIZE, max_num_seqs=8, enable_prefix_caching=False)
    prompts = _prompts()
    eager_tokens, eager_logits = _generate(LLM(path, cuda_graphs=False, **kwargs), prompts)

    padded = LLM(path, cuda_graphs=False, **kwargs)
    padded.engine.runner.enable_padded_decode(capture=False)
    padded_tokens, padded_logits = _generate(padded, prompts)

    graphs = LLM(path, **kwargs)  # on by default on CUDA
    assert graphs.engine.runner.decode_graphs.graphs, "no graph captured"
    replayed = _count_padded_steps(graphs)
    graph_tokens, graph_logits = _generate(graphs, prompts)

    assert len(replayed) >= MAX_TOKENS - 2
    assert graph_tokens == padded_tokens == eager_tokens
    _assert_same_steps(graph_logits, padded_logits, atol=1e-5)  # same kernels, replayed
    _assert_same_steps(graph_logits, eager_logits, atol=1e-4)  # another attention kernel


@pytest.mark.gpu
@requires_cuda
def test_graph_replay_in_bfloat16(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("qwen3"))
    kwargs = dict(device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=16)
    prompts = _prompts() * 3  # 15 sequences: bucket 16
    padded = LLM(path, cuda_graphs=False, **kwargs)
    padded.engine.runner.enable_padded_decode(capture=False)
    padded_tokens, padded_logits = _generate(padded, prompts)
    graph_tokens, graph_logits = _generate(LLM(path, cuda_graphs=True, **kwargs), prompts)
    assert graph_tokens == padded_tokens
    _assert_same_steps(graph_logits, padded_logits, atol=1e-2)


@pytest.mark.gpu
@requires_cuda
def test_decode_steps_sync_the_host_once(tiny_checkpoint) -> None:
    """A greedy decode step's one host sync is reading the sampled tokens; graph replay and the
    eager path add none (pinned, asynchronous input copies)."""
    for cuda_graphs_on in (True, False):
        llm = LLM(str(tiny_checkpoint("llama")), device="cuda", cuda_graphs=cuda_graphs_on)
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i, prompt in enumerate(_prompts()):
            engine.add_request(f"r{i}", prompt, params)
        engine.step()  # prefill
        engine.step()  # first decode: lazy initialisation
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Only the per-operation warnings count: torch also warns once that the debug mode itself
        # is a prototype, and that text says "synchronizing" too (seen on an H200).
        syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) <= 1, (cuda_graphs_on, [str(w.message) for w in syncs])


@pytest.mark.gpu
@requires_cuda
def test_benchmarks_run_on_cuda_with_and_without_graphs(tmp_path: Path) -> None:
    from qiao.bench.common import LengthSpec
    from qiao.bench.latency import LatencyConfig, run_latency
    from qiao.bench.throughput import ThroughputConfig, run_throughput

    for graphs_on in (True, False):
        report = run_throughput(
            ThroughputConfig(
                model=None,
                shape="tiny",
                num_prompts=6,
                input_len=LengthSpec(8, 24),
                output_len=LengthSpec(8, 8),
                device="cuda",
                cuda_graphs=graphs_on,
                max_num_seqs=8,
                ceiling_gflops=1.0,
            )
        )
        assert report["cuda_graphs"] is graphs_on and report["device"].startswith("cuda")
        assert report["num_output_tokens"] == 48 and report["output_tok_s"] > 0
        latency = run_latency(
            LatencyConfig(
                model=None,
                shape="tiny",
                input_len=16,
                batch_size=3,
                decode_steps=4,
                repeat=1,
                device="cuda",
                cuda_graphs=graphs_on,
                copy_gbps=1.0,
            )
        )
        assert latency["cuda_graphs"] is graphs_on and latency["decode_step_s_batch_n"] > 0
