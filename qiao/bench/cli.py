"""Argument wiring of `qiao bench {hw,throughput,latency,serve,embeddings,quality,gguf}`.

Only argparse lives here; each command imports its benchmark (and so torch) when it runs, so
`qiao --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from qiao.bench.common import LengthSpec
from qiao.bench.shapes import shape_names
from qiao.settings_schema import BENCH_SETTINGS, add_engine_flags, engine_group, exclusive_group

# `qiao tune` measures the engine as `serve` and `LLM` would build it.
TUNE_SETTINGS = ("dtype", "load_format", "quantization", "block_size", "seed")

T = TypeVar("T")


def add_tune_command(sub: argparse._SubParsersAction) -> None:
    """Register `qiao tune` (a top-level command: it writes a profile, not a report)."""
    p = sub.add_parser(
        "tune",
        help="measure this machine with a model once; write the profile serve and LLM use",
        description="Measure decode and prefill speed on real engine steps and choose "
        "num_threads, max_num_seqs, max_num_batched_tokens and num_kv_blocks; write them, with "
        "the measurements, as a profile that `qiao serve` and LLM(...) take their defaults "
        "from for this model on this machine. Flags given to them still win.",
    )
    _add_model_source_flags(p, TUNE_SETTINGS, hf_note=False)
    g = p.add_argument_group("tuning")
    g.add_argument("--quick", action="store_true", help="few, short runs (seconds; rough)")
    g.add_argument(
        "--max-memory",
        type=_memory,
        default=None,
        metavar="MEM",
        help="KV cache budget: bytes (4GiB, 512MB) or a share of memory (<= 1); default: "
        "the engine's default KV sizing",
    )
    g.add_argument(
        "--threads",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="thread counts to try (default: 1, 2, 4, ... and the physical cores)",
    )
    g.add_argument(
        "--batch-sizes",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="max_num_seqs to try (default 1,8,16,32,64,128,256; --quick 1,4,8)",
    )
    g.add_argument(
        "--token-budgets",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="max_num_batched_tokens to try (default 256,512,1024,2048; --quick 16,32,64)",
    )
    g.add_argument(
        "--itl-slo",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="tune for serving under this p99 inter-token latency: the token budget becomes "
        "the largest multiple of 16 whose full step (from the measured decode steps) takes at "
        "most 80%% of it, and max_num_seqs at most that budget (default: the budget from the "
        "prefill sweep, for throughput)",
    )
    g.add_argument(
        "--out",
        metavar="PATH",
        default=None,
        help="profile file (default: QIAO_PROFILE_DIR, ~/.cache/qiao/profiles, where serve "
        "and LLM look)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args: argparse.Namespace) -> int:
    from qiao.bench.tune import TuneConfig, run_tune
    from qiao.bench.tune_report import format_tune

    cfg = _config_from_args(TuneConfig, args, show_progress=not args.no_progress)
    profile, path = run_tune(cfg)
    print(format_tune(profile, path))
    return 0


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    """Register the sub-benchmarks under the `qiao bench` parser."""
    sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_hw(sub)
    _add_throughput(sub)
    _add_latency(sub)
    _add_serve(sub)
    _add_embeddings(sub)
    _add_soak(sub)
    _add_quality(sub)
    _add_gguf(sub)
    for name, (module, summary) in _MODULE_BENCHMARKS.items():
        _add_module_benchmark(sub, name, module, summary)


# Benchmarks with their own argument parser (`main(argv)` in their module), run as
# `qiao bench NAME [ARGS]`; `qiao bench NAME --help` prints their flags.
_MODULE_BENCHMARKS = {
    "spec": (
        "qiao.bench.spec_decode",
        "speculative vs plain batch-1 decoding side by side (tok/s, acceptance)",
    ),
    "cache": (
        "qiao.bench.response_cache",
        "qiao serve with the response cache off, then on: hit rate and latency on repeats",
    ),
    "lora": ("qiao.bench.lora", "decode step time with 0, 1 and 4 LoRA adapters in one batch"),
    "adaptive": (
        "qiao.bench.adaptive",
        "SLO-holding request rate: adaptive batching against the best static budget",
    ),
}


def _add_module_benchmark(
    sub: argparse._SubParsersAction, name: str, module: str, summary: str
) -> None:
    # No options of its own ("+" is no flag's prefix): every argument goes to the benchmark.
    p = sub.add_parser(name, help=summary, description=summary, add_help=False, prefix_chars="+")
    p.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help=f"the benchmark's own flags (`qiao bench {name} --help` lists them)",
    )
    p.set_defaults(func=lambda args: _run_module_benchmark(module, name, args.args))


def _run_module_benchmark(module: str, name: str, argv: list[str]) -> int:
    main = importlib.import_module(module).main
    sys.argv[0] = f"qiao bench {name}"
    return main(argv) or 0


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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number")
    return value


_MEMORY_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _memory(text: str) -> float:
    """Bytes ("2e9", "512MiB", "2GB", "4G") or a share of memory ("0.2", at most 1)."""
    # E.g. "1.5GiB" -> ("1.5", "gi") -> 1.5 * 2**30.
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    try:
        value = float(match.group(1)) * _MEMORY_UNITS[(match.group(2) or "").lower()]
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected bytes (e.g. 4GiB, 512MB, 2e9) or a share of memory <= 1"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


# --- shared flags -----------------------------------------------------------------------------


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = _add_model_source_flags(parser, BENCH_SETTINGS, hf_note=True)
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


def _add_model_source_flags(
    parser: argparse.ArgumentParser,
    settings: tuple[str, ...],
    hf_note: bool,
    defaults: dict[str, Any] | None = None,
) -> Any:
    """--model | --shape, then the engine `settings` (qiao/settings_schema.py); returns their
    group. `hf_note`: the benchmark can run HF beside qiao (--compare hf), in the same dtype on
    the same weights; its dtype defaults to float32 then."""
    g = engine_group(parser, "model under test")
    source = exclusive_group(g, required=True)
    add_engine_flags(source, ["model"], config_flag=False, from_env=False)
    source.add_argument(
        "--shape",
        choices=shape_names(),
        help="a built-in published model shape, random weights (no download; load format dummy)",
    )
    notes = {"dtype": "--compare hf runs HF in the same one"} if hf_note else {}
    defaults = {"dtype": "float32", **(defaults or {})} if hf_note else dict(defaults or {})
    add_engine_flags(g, settings, defaults=defaults, notes=notes)
    return g


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
        help="comma-separated: float32, bfloat16, float16, int8 (int8 = qiao's weight-only "
        "int8 linear); float32 and bfloat16 are timed as F.linear and as oneDNN with the "
        "weight prepacked, float32 also as qiao's packed AVX-512 kernel where built, the "
        "ceiling being the fastest; default %(default)s",
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
    add_engine_flags(
        engine_group(p, "engine batching"),
        ["max_num_seqs", "max_num_batched_tokens"],
        defaults={"max_num_seqs": 128, "max_num_batched_tokens": 2048},
        config_flag=False,
    )
    p.set_defaults(
        _engine_settings=["model", *BENCH_SETTINGS, "max_num_seqs", "max_num_batched_tokens"]
    )
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


def _config_from_args(config_cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """A benchmark config whose fields are the same-named flags, plus `extra` (by default
    `--compare hf` -> compare_hf)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(config_cls)
        if hasattr(args, f.name) and f.name not in extra
    }
    if not extra:
        extra = {"compare_hf": args.compare == "hf"}
    return config_cls(**values, **extra)


# --- quality ----------------------------------------------------------------------------------


def _add_quality(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quality",
        help="what quantization or a narrower KV cache costs: greedy agreement and perplexity "
        "against float32",
        description="Run the checkpoint in float32 and with --quantization and / or "
        "--kv-cache-dtype, side by side: greedy continuations of a dozen story prompts (identical outputs, agreeing positions, "
        "mean agreeing prefix) and the perplexity of a fixed story text. The checkpoint needs "
        "its tokenizer; the prompts suit models trained on children's stories (stories260K).",
    )
    add_engine_flags(
        engine_group(p, "the variant measured against float32"),
        ["model", "quantization", "kv_cache_dtype"],
        required=["model"],
        defaults={"quantization": "int8"},
        notes={"quantization": "none: float32 weights"},
    )
    p.add_argument("--max-tokens", type=_positive, default=64, help="greedy tokens per prompt (64)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.set_defaults(func=_cmd_quality)


def _cmd_quality(args: argparse.Namespace) -> int:
    from qiao.bench.quality import QualityConfig, format_quality, run_quality

    cfg = QualityConfig(args.model, args.quantization, args.max_tokens, args.kv_cache_dtype)
    return _report(run_quality, cfg, format_quality, args.json)


# --- gguf -------------------------------------------------------------------------------------


def _add_gguf(sub: argparse._SubParsersAction) -> None:
    from qiao.bench.gguf import FILE_TYPES

    p = sub.add_parser(
        "gguf",
        help="qiao against llama.cpp (llama-cpp-python) on the same GGUF file",
        description="Load one GGUF file in qiao and in llama-cpp-python in turn (the same "
        "threads) and measure batch-1 greedy decode tokens/s and offline output tokens/s on "
        "the same random prompts. --shape writes the file first, random weights in "
        "--file-type. llama-cpp-python is the optional extra qiao[llamacpp]; without it only "
        "qiao runs and the report says how to install it.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", metavar="FILE", help="the .gguf file to load")
    source.add_argument("--shape", choices=shape_names(), help="a built-in shape, random weights")
    p.add_argument(
        "--file-type", choices=FILE_TYPES, default="F32", help="with --shape: matrices' type"
    )
    p.add_argument("--prompt-len", type=_positive, default=128, help="prompt tokens (128)")
    p.add_argument("--output-len", type=_positive, default=64, help="greedy tokens (64)")
    p.add_argument("--batch", type=_positive, default=16, help="offline prompts (16)")
    p.add_argument("--repeats", type=_positive, default=3, help="runs; medians reported (3)")
    p.add_argument("--threads", type=_positive, default=None, help="both engines' threads")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.set_defaults(func=_cmd_gguf)


def _cmd_gguf(args: argparse.Namespace) -> int:
    from qiao.bench.gguf import GGUFBenchConfig, format_gguf_bench, run_gguf_bench

    cfg = GGUFBenchConfig(
        gguf=args.gguf,
        shape=args.shape,
        file_type=args.file_type,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        batch=args.batch,
        repeats=args.repeats,
        threads=args.threads,
    )
    return _report(run_gguf_bench, cfg, format_gguf_bench, args.json)


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
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature sent with every request (default: none sent, the server's "
        "default); 0 samples greedily, as `qiao bench throughput` does",
    )
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, s")
    p.add_argument("--slo-itl", type=float, default=0.25, help="goodput SLO on mean ITL, s")
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="arrival shape: gamma gaps of this shape (1: Poisson; below 1: bursty)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="runs per rate, each with its own arrivals and prompts, taken round by round; "
        "the report gives each rate's medians and the SLO verdict on them (default 1)",
    )
    p.add_argument(
        "--with-batch",
        type=_positive,
        default=None,
        metavar="LINES",
        help="run the rates alone, then again beside a /v1/batches job of LINES completion "
        "lines (same --input-len / --output-len) and compare: goodput, p50 TTFT and the "
        "highest rate within the SLO, with the batch's own lines/s meanwhile; the batch is "
        "cancelled at the end. Give enough lines that it outlasts the second run",
    )
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
        temperature=args.temperature,
        slo_ttft=args.slo_ttft,
        slo_itl=args.slo_itl,
        seed=args.seed,
        repeat=args.repeat,
        show_progress=not args.no_progress,
        with_batch=args.with_batch,
        burstiness=args.burstiness,
    )
    if cfg.burstiness <= 0:
        from qiao.errors import ConfigError

        raise ConfigError(f"--burstiness must be > 0, got {cfg.burstiness}")
    report = run_serve(cfg)
    print(format_serve(report))
    write_json(args.json, report)
    if args.plot:
        plot_serve(report, args.plot)
    return 0


# --- embeddings -------------------------------------------------------------------------------


def _add_embeddings(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "embeddings",
        help="load-test any OpenAI-compatible /v1/embeddings endpoint: QPS at a p99 SLO",
        description="Closed-loop (fixed concurrency) or open-loop (Poisson rate) load on "
        "/v1/embeddings; per level: QPS, inputs/s, latency p50/p90/p99/max, errors by kind, and "
        "whether p99 met the SLO; per server: the highest QPS whose level met it. "
        "--compare-url / --compare-model run the same levels against a second server or model "
        "(e.g. without dynamic batching) and give the ratio of their QPS at the SLO.",
    )
    g = p.add_argument_group("servers")
    g.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    g.add_argument("--model", required=True, help="model name to send")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token (to both servers)")
    g.add_argument(
        "--compare-url",
        default=None,
        metavar="URL",
        help="a second server to run the same levels against (default: --base-url when "
        "--compare-model is given)",
    )
    g.add_argument(
        "--compare-model",
        default=None,
        metavar="NAME",
        help="model name on the second server (default: --model)",
    )
    g = p.add_argument_group("load")
    levels = g.add_mutually_exclusive_group()
    levels.add_argument(
        "--concurrency",
        type=_int_list,
        default=None,
        metavar="C,C,...",
        help="closed loop: clients that each send a request as soon as the last one returns "
        "(default 1,8,32,64)",
    )
    levels.add_argument(
        "--rate",
        type=_rate_list,
        default=None,
        metavar="R,R,...",
        help="open loop: Poisson arrivals at these requests/s instead",
    )
    span = g.add_mutually_exclusive_group()
    span.add_argument(
        "--duration", type=float, default=10.0, help="seconds of sending per level (default 10)"
    )
    span.add_argument(
        "--num-requests", type=_positive, default=None, help="requests per level instead"
    )
    g.add_argument(
        "--inputs-per-request", type=_positive, default=1, help="texts per request (default 1)"
    )
    g.add_argument(
        "--input-len",
        type=_length,
        default=LengthSpec(32, 32),
        help="words per text (about one token each), N or LO:HI uniform (default 32)",
    )
    g.add_argument(
        "--encoding-format",
        choices=["float", "base64"],
        default="float",
        help="vector encoding asked of the server (default float)",
    )
    g.add_argument(
        "--p99-slo-ms", type=float, default=200.0, help="latency SLO at p99, ms (default 200)"
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=16,
        help="unrecorded requests per server before the first level; the first checks that "
        "the server answers (default 16). Each closed-loop level also first opens its "
        "connections with one unrecorded request per client",
    )
    g.add_argument(
        "--request-timeout", type=float, default=30.0, help="per-request deadline, s (default 30)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the texts and arrival times")
    g.add_argument(
        "--workers",
        type=_positive,
        default=1,
        help="client processes sharing each level (default 1); more when one is CPU-bound "
        "(the table's cpu column near 100%%)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--out", "--json", dest="out", metavar="PATH", help="write the report as JSON")
    g.add_argument(
        "--plot", metavar="PATH", help="write a PNG of p99 and p50 latency vs QPS, SLO line"
    )
    g.add_argument(
        "--quiet", "--no-progress", dest="quiet", action="store_true", help="no progress bars"
    )
    p.set_defaults(func=_cmd_embeddings)


def _cmd_embeddings(args: argparse.Namespace) -> int:
    from qiao.bench.common import write_json
    from qiao.bench.embeddings import EmbeddingsBenchConfig, run_embeddings
    from qiao.bench.embeddings_report import format_embeddings, plot_embeddings

    cfg = EmbeddingsBenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        concurrencies=args.concurrency or EmbeddingsBenchConfig.concurrencies,
        rates=args.rate,
        duration=args.duration,
        num_requests=args.num_requests,
        inputs_per_request=args.inputs_per_request,
        input_len=args.input_len,
        encoding_format=args.encoding_format,
        p99_slo_ms=args.p99_slo_ms,
        warmup=args.warmup,
        request_timeout=args.request_timeout,
        seed=args.seed,
        compare_url=args.compare_url,
        compare_model=args.compare_model,
        workers=args.workers,
        show_progress=not args.quiet,
    )
    report = run_embeddings(cfg)
    print(format_embeddings(report))
    write_json(args.out, report)
    if args.plot:
        plot_embeddings(report, args.plot)
    failed = [run for run in report["runs"] if run["num_completed"] == 0]
    for run in failed:
        first = next((lv["first_error"] for lv in run["levels"] if lv["first_error"]), None)
        print(
            f"qiao bench embeddings: every request to {run['base_url']} ({run['model']!r}) "
            f"failed; first error: {first}",
            file=sys.stderr,
        )
    return 1 if failed else 0


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


# --- soak -------------------------------------------------------------------------------------


def _duration(text: str) -> float:
    """Seconds, or a number with s / m / h: 90, 90s, 30m, 2h."""
    scale = {"s": 1, "m": 60, "h": 3600}.get(text[-1:].lower())
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        message = f"expected a duration like 90, 30m or 2h, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if value <= 0:
        raise argparse.ArgumentTypeError("the duration must be > 0")
    return value


def _add_soak(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak",
        help="a steady mixed load for a long time, with a memory-leak verdict",
        description="Closed-loop mixed load (completions, chat, streams, streams dropped "
        "mid-way, embeddings when served) on a running qiao server; samples the API and engine "
        "processes' resident memory and the load gauges from /metrics, and judges a leak from "
        "the memory slope after a warm-up. Exits 1 on a leak.",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--duration", type=_duration, default=60.0, help="load time: 90, 30m, 2h (default 60 s)"
    )
    p.add_argument("--concurrency", type=_positive, default=4, help="requests in flight")
    p.add_argument(
        "--sample-interval", type=_positive_float, default=5.0, help="seconds between samples"
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="share of the duration left out of the verdict (default %(default)s)",
    )
    p.add_argument(
        "--max-slope",
        type=float,
        default=1.0,
        help="MiB per minute of memory growth after the warm-up judged a leak (default "
        "%(default)s)",
    )
    p.add_argument("--model", default=None, help="generative model (default: the first listed)")
    p.add_argument(
        "--embedding-model", default=None, help="embedding model (default: the first listed)"
    )
    p.add_argument("--max-tokens", type=_positive, default=32, help="max_tokens per request")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix and prompts")
    p.add_argument("--json", metavar="PATH", help="also write the report (all samples) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no line per sample")
    p.set_defaults(func=_cmd_soak)


def _cmd_soak(args: argparse.Namespace) -> int:
    from qiao.bench.soak import SoakConfig, format_soak, run_soak, write_report

    cfg = SoakConfig(
        base_url=args.base_url,
        duration=args.duration,
        concurrency=args.concurrency,
        sample_interval=args.sample_interval,
        warmup=args.warmup,
        max_slope=args.max_slope,
        model=args.model,
        embedding_model=args.embedding_model,
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        seed=args.seed,
    )
    report = run_soak(cfg, progress=not args.no_progress)
    print(format_soak(report))
    write_report(args.json, report)
    return 1 if report.leak else 0
