"""Argument wiring of `qiao bench {hw,throughput,latency,serve}`.

Only argparse lives here; each command imports its benchmark (and so torch) when it runs, so
`qiao --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from qiao.bench.common import LengthSpec
from qiao.bench.shapes import shape_names

T = TypeVar("T")


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    """Register the sub-benchmarks under the `qiao bench` parser."""
    sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_hw(sub)
    _add_throughput(sub)
    _add_latency(sub)
    _add_serve(sub)


# --- argument types ---------------------------------------------------------------------------


def _length(text: str) -> LengthSpec:
    try:
        return LengthSpec.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers, e.g. 1,8,32") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _rate(text: str) -> float:
    try:
        rate = math.inf if text.strip() == "inf" else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number or inf") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a request rate must be > 0")
    return rate


def _rate_list(text: str) -> tuple[float, ...]:
    return tuple(_rate(v) for v in text.split(",") if v.strip())


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be >= 1")
    return value


# --- shared flags -----------------------------------------------------------------------------


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model under test")
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="Hugging Face checkpoint directory")
    source.add_argument(
        "--shape",
        choices=shape_names(),
        help="a built-in published model shape, random weights (no download)",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="how qiao loads --model (always dummy for --shape and --compare hf)",
    )
    g.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="qiao's dtype; HF runs in the same one (default %(default)s)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        help="passed to LLM(quantization=...); an error if this qiao's LLM does not take it",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and lengths")
    g.add_argument(
        "--repeat", type=_positive, default=3, help="runs; figures are medians (default 3)"
    )
    g.add_argument(
        "--compare",
        choices=["hf"],
        default=None,
        help="hf: also run Hugging Face transformers on the same weights, in the same run",
    )
    g.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


# --- hw ---------------------------------------------------------------------------------------


def _add_hw(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hw",
        help="this machine's ceilings: copy bandwidth and matmul GFLOP/s per dtype",
        description="Measure memory-copy bandwidth (read + write bytes/s, median) and matmul "
        "rates for decode-like (M=1..64) and prefill-like (M=512) shapes per dtype.",
    )
    p.add_argument(
        "--dtypes",
        default="float32,bfloat16,int8",
        help="comma-separated: float32, bfloat16, float16, int8 (int8 = weight-only "
        "torch._weight_int8pack_mm, skipped where unsupported); default %(default)s",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (seconds, less accurate)")
    p.add_argument(
        "--min-time", type=float, default=None, help="seconds to time each matmul (default 0.25)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.set_defaults(func=_cmd_hw)


def _cmd_hw(args: argparse.Namespace) -> int:
    from qiao.bench.common import write_json
    from qiao.bench.hw import format_hw, run_hw

    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in ("float32", "bfloat16", "float16", "int8")]
    if unknown:
        print(f"qiao bench hw: error: unknown dtype(s) {unknown}", file=sys.stderr)
        return 2
    report = run_hw(dtypes, quick=args.quick, min_time=args.min_time)
    print(format_hw(report))
    write_json(args.json, report.to_dict())
    return 0


# --- throughput -------------------------------------------------------------------------------


def _add_throughput(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "throughput",
        help="offline tokens/s through LLM.generate, optionally beside HF generate()",
        description="Offline throughput on random token-id prompts: output and total tok/s, "
        "requests/s, achieved FLOP/s as a share of the matmul ceiling; --compare hf runs HF "
        "generate() on the same weights and prompts, interleaved, at several batch sizes.",
    )
    _add_model_flags(p)
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=_positive, default=64, help="default %(default)s")
    g.add_argument(
        "--input-len", type=_length, default=LengthSpec(128, 128), help="N or LO:HI (uniform)"
    )
    g.add_argument(
        "--output-len", type=_length, default=LengthSpec(128, 128), help="N or LO:HI (uniform)"
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --output-len tokens (default on)",
    )
    g.add_argument("--max-num-seqs", type=_positive, default=128, help="engine batch limit")
    g.add_argument(
        "--max-num-batched-tokens", type=_positive, default=2048, help="engine token budget"
    )
    g.add_argument(
        "--hf-batch-sizes",
        type=_int_list,
        default=(1, 8, 32, 64),
        help="HF static batch sizes to try; the best counts (default 1,8,32,64)",
    )
    g.add_argument(
        "--ceiling-gflops",
        type=float,
        default=None,
        help="matmul ceiling to divide by (default: measured in this run)",
    )
    g.add_argument(
        "--quick-ceiling",
        action="store_true",
        help="measure the ceiling on one small matmul (fast, less accurate)",
    )
    p.set_defaults(func=_cmd_throughput)


def _cmd_throughput(args: argparse.Namespace) -> int:
    from qiao.bench.throughput import ThroughputConfig, format_throughput, run_throughput

    cfg = _config_from_args(ThroughputConfig, args)
    return _report(run_throughput, cfg, format_throughput, args.json)


def _config_from_args(config_cls: type[T], args: argparse.Namespace) -> T:
    """A benchmark config whose fields are the same-named flags (`--compare hf` -> compare_hf)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(config_cls)
        if hasattr(args, f.name)
    }
    return config_cls(**values, compare_hf=args.compare == "hf")


# --- latency ----------------------------------------------------------------------------------


def _add_latency(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "latency",
        help="prefill and per-token decode time at batch 1 and batch N",
        description="Time the prefill step and steady-state decode steps through the engine's "
        "step(), at batch 1 and --batch-size; report batch-1 decode's weight bandwidth as a "
        "share of copy bandwidth. --compare hf times HF forward() batch-1 prefill and decode.",
    )
    _add_model_flags(p)
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=_positive, default=128, help="prompt tokens per sequence")
    g.add_argument("--batch-size", type=_positive, default=8, help="the batch N (default 8)")
    g.add_argument(
        "--decode-steps", type=_positive, default=32, help="decode steps timed after prefill"
    )
    g.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help="copy bandwidth to divide by, GB/s (default: measured in this run)",
    )
    g.add_argument(
        "--quick-bandwidth",
        action="store_true",
        help="measure bandwidth on a small tensor (fast, less accurate)",
    )
    p.set_defaults(func=_cmd_latency)


def _cmd_latency(args: argparse.Namespace) -> int:
    from qiao.bench.latency import LatencyConfig, format_latency, run_latency

    cfg = _config_from_args(LatencyConfig, args)
    return _report(run_latency, cfg, format_latency, args.json)


# --- serve ------------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="load-test any OpenAI-compatible server (qiao, vLLM, llama.cpp)",
        description="Open-loop Poisson load on a running server with streaming requests; per "
        "request rate: TTFT, ITL and E2E percentiles, request and token throughput, goodput "
        "under an SLO.",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: first of /v1/models)")
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions (default %(default)s)",
    )
    rates = p.add_mutually_exclusive_group()
    rates.add_argument(
        "--request-rate", type=_rate, default=None, help="requests/s, or inf (default inf)"
    )
    rates.add_argument(
        "--request-rates", type=_rate_list, default=None, help="a sweep, e.g. 1,2,4,8"
    )
    p.add_argument("--num-prompts", type=_positive, default=100, help="requests per rate")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of arrivals per rate instead of --num-prompts (finite rates only)",
    )
    p.add_argument(
        "--input-len", type=_length, default=LengthSpec(128, 128), help="prompt words, N or LO:HI"
    )
    p.add_argument(
        "--output-len", type=_length, default=LengthSpec(128, 128), help="max_tokens, N or LO:HI"
    )
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--request-timeout", type=float, default=120.0, help="per-request deadline, s")
    p.add_argument(
        "--max-concurrency", type=_positive, default=None, help="cap on requests in flight"
    )
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, s")
    p.add_argument("--slo-itl", type=float, default=0.25, help="goodput SLO on mean ITL, s")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of latency percentiles vs rate")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from qiao.bench.common import write_json
    from qiao.bench.serve import ServeConfig, run_serve
    from qiao.bench.serve_report import format_serve, plot_serve

    rates = args.request_rates or (args.request_rate or math.inf,)
    cfg = ServeConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        request_rates=rates,
        num_prompts=args.num_prompts,
        duration=args.duration,
        input_len=args.input_len,
        output_len=args.output_len,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        max_concurrency=args.max_concurrency,
        slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl,
        seed=args.seed,
        show_progress=not args.no_progress,
    )
    report = run_serve(cfg)
    print(format_serve(report))
    write_json(args.json, report)
    if args.plot:
        plot_serve(report, args.plot)
    return 0


def _report(
    run: Callable[[Any], dict[str, Any]],
    cfg: Any,
    formatter: Callable[[dict[str, Any]], str],
    json_path: str | None,
) -> int:
    from qiao.bench.common import write_json

    report = run(cfg)
    print(formatter(report))
    write_json(json_path, report)
    return 0
