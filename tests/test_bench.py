"""Smoke tests of `qiao bench`: every benchmark runs on a tiny shape and reports well-formed
figures. No timing is asserted: only that numbers exist, are positive and are consistent."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from qiao.bench.cli import add_bench_subcommands
from qiao.bench.common import LengthSpec, build_llm, context_len, model_dir
from qiao.bench.flops import sequence_flops, token_flops
from qiao.bench.hw import impls_for
from qiao.bench.serve import ServeConfig, make_jobs
from qiao.bench.shapes import SHAPES, shape_config
from qiao.cli import main
from qiao.layers.linear_method import packed_f32_ops
from qiao.models.arch_config import ArchConfig

STORIES_DIR = (Path(__file__).parents[1] / "../shared/models/stories260K-hf").resolve()

# Published parameter counts of the real models the built-in shapes copy.
PUBLISHED_PARAMS = {
    "smollm2-135m": 134_515_008,
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.2-1b": 1_235_814_400,
}


def _run_cli(argv: list[str], json_path: Path) -> dict:
    assert main(argv + ["--json", str(json_path)]) == 0
    return json.loads(json_path.read_text())


# --- shapes and FLOPs -------------------------------------------------------------------------


def _param_count(arch: ArchConfig) -> int:
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * arch.intermediate_size + 2 * h
    if arch.attention_bias:  # Qwen2: q, k and v biases
        per_layer += q + 2 * kv
    embeddings = arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
    return arch.num_hidden_layers * per_layer + embeddings + h


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_shapes_match_published_parameter_counts(name: str) -> None:
    assert _param_count(ArchConfig.from_dict(shape_config(name))) == PUBLISHED_PARAMS[name]


def test_llama_3_2_shape_has_llama3_rope() -> None:
    arch = ArchConfig.from_dict(shape_config("llama-3.2-1b"))
    assert arch.rope_theta == 500000.0 and arch.max_position_embeddings == 131072
    assert arch.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_flops_match_hand_computation() -> None:
    arch = ArchConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "vocab_size": 10,
        }
    )
    # Per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192; gate, up, down 3 x 8x16 = 384 -> 576.
    linear = 2 * 576 * 2  # 2 FLOPs per weight, 2 layers
    attention_per_key = 4 * 2 * 4 * 2  # (QK^T + PV) x heads x head_dim x layers
    lm_head = 2 * 8 * 10
    assert token_flops(arch, 5, compute_logits=False) == linear + 5 * attention_per_key
    assert token_flops(arch, 5, compute_logits=True) == linear + 5 * attention_per_key + lm_head
    # Prompt 3, output 2: the model runs on 4 tokens (context 1..4), logits for 2 of them.
    expected = 4 * linear + (1 + 2 + 3 + 4) * attention_per_key + 2 * lm_head
    assert sequence_flops(arch, 3, 2) == expected


def test_flops_cap_attention_at_the_sliding_window() -> None:
    d = {**shape_config("tiny"), "architectures": ["MistralForCausalLM"], "sliding_window": 2}
    windowed, full = ArchConfig.from_dict(d), ArchConfig.from_dict(shape_config("tiny"))
    assert token_flops(windowed, 10, False) == token_flops(full, 2, False)
    # Contexts 1..4 capped at 2 -> 1 + 2 + 2 + 2 keys; one output token -> logits once.
    per_key = token_flops(full, 2, False) - token_flops(full, 1, False)
    base = token_flops(full, 0, False)
    lm_head = token_flops(full, 0, True) - base
    assert sequence_flops(windowed, 4, 1) == 4 * base + 7 * per_key + lm_head


def test_length_spec_and_poisson_jobs() -> None:
    assert LengthSpec.parse("7") == LengthSpec(7, 7)
    assert LengthSpec.parse("3:9") == LengthSpec(3, 9)
    for bad in ("0", "9:3", "x"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)
    cfg = ServeConfig(base_url="http://x", num_prompts=5, input_len=LengthSpec(2, 4))
    jobs = make_jobs(cfg, rate=10.0, seed=0)
    assert len(jobs) == 5 and jobs[0].arrival == 0.0
    assert all(a.arrival < b.arrival for a, b in itertools.pairwise(jobs))
    assert all(2 <= len(j.prompt.split()) <= 4 for j in jobs)
    assert all(j.arrival == 0.0 for j in make_jobs(cfg, rate=math.inf, seed=0))
    timed = make_jobs(ServeConfig(base_url="http://x", duration=2.0), rate=50.0, seed=0)
    assert 50 < len(timed) < 150 and timed[-1].arrival < 2.0


def test_serve_request_body_sends_temperature_only_when_set() -> None:
    from qiao.bench.serve import _request_body

    job = make_jobs(ServeConfig(base_url="http://x", num_prompts=1), rate=1.0, seed=0)[0]
    url, body = _request_body(ServeConfig(base_url="http://x"), "m", job)
    assert url == "http://x/v1/completions" and "temperature" not in body
    _, body = _request_body(ServeConfig(base_url="http://x", temperature=0.0), "m", job)
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True


def test_help_documents_every_flag() -> None:
    bench = argparse.ArgumentParser(prog="qiao bench")
    add_bench_subcommands(bench)
    subparsers = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {
        "hw",
        "throughput",
        "latency",
        "serve",
        "quality",
        "embeddings",
        "soak",
        "gguf",
        "spec",
        "cache",
        "lora",
        "adaptive",
    }
    for name, parser in subparsers.choices.items():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"qiao bench {name} {action.option_strings} lacks help"


# --- offline benchmarks ---------------------------------------------------------------------


def test_hw_reports_bandwidth_and_ceilings(tmp_path: Path) -> None:
    report = _run_cli(
        ["bench", "hw", "--quick", "--dtypes", "float32,int8", "--min-time", "0.01"],
        tmp_path / "hw.json",
    )
    assert report["copy_gbps"] > 0
    assert report["ceiling_gflops"]["float32"] > 0
    assert {(m["dtype"], m["m"]) for m in report["matmuls"]} >= {("float32", 1), ("float32", 256)}
    assert all(m["gflops"] > 0 and m["weight_gbps"] > 0 for m in report["matmuls"])
    assert report["ceiling_gflops"]["int8"] > 0
    assert {m["impl"] for m in report["matmuls"] if m["dtype"] == "int8"} == {"qiao"}
    float32_impls = {m["impl"] for m in report["matmuls"] if m["dtype"] == "float32"}
    assert float32_impls == set(impls_for("float32"))
    if packed_f32_ops(torch.empty(0)) is not None:  # the float32 layers' own kernel is timed
        assert "qiao" in float32_impls


def test_throughput_with_hf_comparison(tmp_path: Path) -> None:
    argv = ["bench", "throughput", "--shape", "tiny", "--num-prompts", "4", "--input-len", "8:16"]
    argv += ["--output-len", "4", "--repeat", "1", "--max-num-seqs", "4", "--quick-ceiling"]
    report = _run_cli([*argv, "--compare", "hf", "--hf-batch-sizes", "1,4,8"], tmp_path / "t.json")
    assert report["num_requests"] == 4 and report["num_output_tokens"] == 16
    for key in ("output_tok_s", "total_tok_s", "requests_per_s", "achieved_gflops"):
        assert report[key] > 0, key
    assert report["share_of_ceiling"] == pytest.approx(
        report["achieved_gflops"] / report["ceiling_gflops"]
    )
    hf = report["hf"]
    assert set(hf["output_tok_s_by_batch_size"]) == {"1", "4"}  # 8 > num_prompts: skipped
    best = max(hf["output_tok_s_by_batch_size"].values())
    assert hf["best_output_tok_s"] == best
    assert hf["qiao_over_hf_output_tok_s"] == pytest.approx(report["output_tok_s"] / best)


def test_latency_with_hf_comparison(tmp_path: Path) -> None:
    argv = ["bench", "latency", "--shape", "tiny", "--input-len", "16", "--batch-size", "3"]
    argv += ["--decode-steps", "3", "--repeat", "1", "--quick-bandwidth", "--compare", "hf"]
    argv += ["--kv-cache-dtype", "bfloat16"]
    report = _run_cli(argv, tmp_path / "l.json")
    assert report["config"]["kv_cache_dtype"] == "bfloat16"
    for key in (
        "prefill_s_batch_1",
        "prefill_s_batch_n",
        "decode_step_s_batch_1",
        "decode_step_s_batch_n",
        "weight_gbps_batch_1",
        "share_of_copy_bandwidth",
        "copy_gbps",
    ):
        assert report[key] > 0, key
    for key in ("step_overhead_batch_1", "step_overhead_batch_n"):
        assert 0 < report[key] < 1, key
    assert report["prefill_tok_s_batch_n"] == pytest.approx(3 * 16 / report["prefill_s_batch_n"])
    hf = report["hf"]
    assert hf["qiao_over_hf_decode"] == pytest.approx(
        report["decode_tok_s_batch_1"] / hf["decode_tok_s_batch_1"]
    )
    assert hf["qiao_over_hf_prefill"] > 0


def test_hf_twin_has_identical_weights() -> None:
    import torch

    from qiao.bench.common import EngineArgs
    from qiao.bench.hf_baseline import build_with_hf_twin, hf_greedy_tokens
    from qiao.sampling_params import SamplingParams

    args = EngineArgs("dummy", "float32", None, 1, 256, context_len(64))
    with model_dir(None, "tiny") as path:
        llm, hf = build_with_hf_twin(path, args)
    qiao_model = llm.engine.runner.model
    assert torch.equal(
        qiao_model.model.embed_tokens.weight, hf.state_dict()["model.embed_tokens.weight"]
    )
    prompt = [5, 17, 300, 42, 7, 99, 123, 4]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    qiao_tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    hf_tokens = hf_greedy_tokens(hf, prompt, 12)
    assert qiao_tokens == hf_tokens
    assert len(set(hf_tokens)) > 1, "degenerate weights would make this comparison vacuous"


def test_unsupported_quantization_is_a_clear_error() -> None:
    from qiao.bench.common import EngineArgs
    from qiao.errors import ConfigError

    with model_dir(None, "tiny") as path, pytest.raises(ConfigError, match="quantization"):
        build_llm(path, EngineArgs("dummy", "float32", "no-such-scheme", 1, 256, 128))


# --- serve ------------------------------------------------------------------------------------


def test_max_rate_within_p99_slo_needs_both_tails_and_no_errors() -> None:
    from qiao.bench.serve_report import max_rate_within_p99_slo

    def rate(r: float | str, ttft: float, itl: float, errors: int = 0) -> dict:
        return {
            "request_rate": r,
            "num_errors": errors,
            "slo": {"ttft_s": 2.0, "itl_s": 0.25},
            "ttft_s": {"p99": ttft},
            "itl_s": {"p99": itl},
            "output_token_throughput": 1.0,
        }

    rates = [rate(0.5, 0.3, 0.1), rate(1, 1.9, 0.2), rate(1.5, 1.0, 0.3), rate(2, 2.5, 0.1)]
    assert max_rate_within_p99_slo({"rates": rates})["request_rate"] == 1
    rates[1]["num_errors"] = 1
    assert max_rate_within_p99_slo({"rates": rates})["request_rate"] == 0.5
    assert max_rate_within_p99_slo({"rates": [rate("inf", 3.0, 0.1)]}) is None


def test_repeated_runs_report_medians_and_judge_the_slo_on_them() -> None:
    from qiao.bench.serve_report import format_serve, max_rate_within_p99_slo, median_of_runs

    def run(ttft_p99: float, itl_p99: float, tok_s: float, errors: int = 0) -> dict:
        stats = {"mean": 0.1, "p50": 0.1, "p90": 0.2}
        return {
            "request_rate": 1.3,
            "num_requests": 300,
            "num_completed": 300 - errors,
            "num_errors": errors,
            "errors": {"HTTP 500: boom": errors} if errors else {},
            "duration_s": 240.0,
            "num_output_tokens": 38400,
            "num_prompt_tokens": 38400,
            "request_throughput": tok_s / 128,
            "output_token_throughput": tok_s,
            "total_token_throughput": 2 * tok_s,
            "goodput": 1.2,
            "slo": {"ttft_s": 2.0, "itl_s": 0.25},
            "ttft_s": {**stats, "p99": ttft_p99},
            "itl_s": {**stats, "p99": itl_p99},
            "e2e_s": {**stats, "p99": 20.0},
        }

    # One run's burst of arrivals (7.4 s) does not decide the rate; the median does.
    rate = median_of_runs([run(1.8, 0.21, 160.0), run(7.4, 0.27, 150.0), run(1.9, 0.23, 170.0)])
    assert rate["num_runs"] == 3 and rate["num_completed"] == 900
    assert rate["ttft_s"]["p99"] == 1.9 and rate["itl_s"]["p99"] == 0.23
    assert rate["output_token_throughput"] == 160.0
    report = {
        "config": {
            "base_url": "http://x",
            "endpoint": "completions",
            "input_len": "128",
            "output_len": "128",
            "slo_ttft": 2.0,
            "slo_itl": 0.25,
            "repeat": 3,
        },
        "model": "m",
        "rates": [rate],
    }
    assert max_rate_within_p99_slo(report) is rate
    text = format_serve(report)
    assert "medians of 3 runs per rate" in text
    assert "runs' p99 TTFT/ITL ms: 1800/210, 7400/270, 1900/230" in text
    # An error in any run fails the rate, whatever the medians say.
    failed = median_of_runs([run(1.8, 0.21, 160.0), run(1.9, 0.22, 150.0, errors=1)])
    assert failed["num_errors"] == 1 and failed["errors"] == {"HTTP 500: boom": 1}
    assert max_rate_within_p99_slo({"rates": [failed]}) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def qiao_server() -> Iterator[str]:
    """A real `qiao serve` of stories260K on a free loopback port, stopped afterwards."""
    if not (STORIES_DIR / "config.json").is_file():
        pytest.skip(f"real weights not present: {STORIES_DIR}")
    port = _free_port()
    argv = [sys.executable, "-m", "qiao.cli", "serve", "--model", str(STORIES_DIR)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-interval", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, base_url, timeout=60.0)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"qiao serve exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{base_url}/health/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"qiao serve not ready after {timeout} s")


def test_serve_sweep_against_qiao_server(qiao_server: str, tmp_path: Path) -> None:
    plot = tmp_path / "serve.png"
    argv = ["bench", "serve", "--base-url", qiao_server, "--request-rates", "4,inf"]
    argv += ["--num-prompts", "6", "--input-len", "4:8", "--output-len", "6", "--no-progress"]
    argv += ["--request-timeout", "30", "--plot", str(plot), "--repeat", "2"]
    report = _run_cli(argv, tmp_path / "s.json")
    assert report["model"] == "stories260K-hf"
    assert [r["request_rate"] for r in report["rates"]] == [4.0, "inf"]
    for r in report["rates"]:
        assert r["num_runs"] == 2 and len(r["runs"]) == 2
        assert r["num_completed"] == 12 and r["num_errors"] == 0, r["errors"]
        assert all(run["num_completed"] == 6 for run in r["runs"])
        assert r["num_output_tokens"] == 36  # ignore_eos: exactly max_tokens each, per run
        tails = sorted(run["ttft_s"]["p99"] for run in r["runs"])
        assert r["ttft_s"]["p99"] == pytest.approx(sum(tails) / 2)  # median of two
        assert r["request_throughput"] > 0 and r["output_token_throughput"] > 0
        assert 0 < r["goodput"] <= r["request_throughput"]
        for key in ("ttft_s", "itl_s", "e2e_s"):
            assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"], key
    assert plot.stat().st_size > 1000


def test_serve_counts_errors_without_failing(qiao_server: str, tmp_path: Path) -> None:
    argv = ["bench", "serve", "--base-url", qiao_server, "--model", "no-such-model"]
    argv += ["--num-prompts", "3", "--output-len", "2", "--no-progress", "--endpoint", "chat"]
    report = _run_cli(argv, tmp_path / "e.json")
    (rate,) = report["rates"]
    assert rate["num_errors"] == 3 and rate["num_completed"] == 0
    assert any("404" in message for message in rate["errors"])
    assert rate["ttft_s"]["p50"] is None


def test_all_shapes_are_listed() -> None:
    assert {"smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "tiny"} <= set(SHAPES)


def test_serve_with_batch_comparison_ratios_and_slo_rates() -> None:
    from qiao.bench.serve_batch import batch_progress, compare

    def rate(r: float | str, goodput: float, ttft: float, itl: float) -> dict:
        return {
            "request_rate": r,
            "goodput": goodput,
            "num_errors": 0,
            "slo": {"ttft_s": 1.0, "itl_s": 0.1},
            "ttft_s": {"p50": ttft, "p99": ttft},
            "itl_s": {"p50": itl, "p99": itl},
        }

    alone = {"rates": [rate(2.0, 2.0, 0.1, 0.01), rate(4.0, 4.0, 0.5, 0.05)]}
    beside = {"rates": [rate(2.0, 1.5, 0.2, 0.02), rate(4.0, 3.0, 2.0, 0.05)]}
    out = compare(alone, beside)
    assert [r["goodput_ratio"] for r in out["rates"]] == [0.75, 0.75]
    assert [r["ttft_p50_ratio"] for r in out["rates"]] == [2.0, 4.0]
    # Alone 4 req/s met the SLO; beside the batch only 2 did (its p99 TTFT 2 s > 1 s).
    assert (out["slo_rate_alone"], out["slo_rate_beside_batch"], out["slo_rate_ratio"]) == (
        4.0,
        2.0,
        0.5,
    )
    none_beside = {"rates": [rate(2.0, 1.0, 3.0, 0.01), rate(4.0, 1.0, 3.0, 0.05)]}
    assert compare(alone, none_beside)["slo_rate_ratio"] == 0.0
    before = {"id": "b", "status": "in_progress", "request_counts": {"completed": 10, "failed": 2}}
    after = {
        "id": "b",
        "status": "completed",
        "request_counts": {"total": 50, "completed": 40, "failed": 2},
    }
    progress = batch_progress(before, after, 10.0, 32.0)
    assert progress["lines_during_ladder"] == 30 and progress["lines_per_s"] == 3.0
    assert progress["output_tokens_per_s"] == 96.0 and not progress["ran_throughout"]
