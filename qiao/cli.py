"""The `qiao` command line. Each subcommand documents its flags in `--help`."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from qiao.bench.cli import add_bench_subcommands, add_tune_command
from qiao.errors import QiaoError
from qiao.logs import configure_logging
from qiao.repository.cli import add_repository_command
from qiao.settings_schema import (
    GENERATE_SETTINGS,
    add_engine_flags,
    engine_group,
    engine_kwargs,
    resolve_engine_flags,
)


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens per sample (default %(default)s)"
    )
    g.add_argument(
        "--min-tokens", type=int, default=0, help="tokens before EOS/stop ids may end a sample"
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)"
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    g.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p x the top prob"
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="HF-style, > 1 discourages repeats"
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI-style, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI-style, in [-2, 2]")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        default=[],
        help="stop token id (repeatable)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("-n", type=int, default=1, help="samples per prompt")
    g.add_argument("--logprobs", type=int, default=None, help="return the top-k logprobs per token")


def _cmd_generate(args: argparse.Namespace) -> int:
    from qiao import LLM, SamplingParams

    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    llm = LLM(args.model, **engine_kwargs(vars(args)))
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for output in outputs:
        for sample in output.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": output.prompt,
                            "index": sample.index,
                            "text": sample.text,
                            "token_ids": sample.token_ids,
                            "finish_reason": sample.finish_reason,
                        }
                    )
                )
            else:
                print(f"{output.prompt}{sample.text}")
    return 0


def _add_batch_command(sub: argparse._SubParsersAction) -> None:
    from qiao.batch.cli import add_batch_run_flags

    batch = sub.add_parser(
        "batch",
        help="offline batch jobs over OpenAI batch files: run",
        description="Offline batch work over OpenAI batch files (custom_id, method, url, body).",
    )
    commands = batch.add_subparsers(dest="batch_command", required=True)
    run = commands.add_parser(
        "run",
        help="run an OpenAI batch file to an output file; resumable",
        description="Run every line of an OpenAI batch input file (/v1/chat/completions, "
        "/v1/completions, /v1/embeddings) on an in-process engine and write OpenAI's output "
        "file (answered lines) and error file (refused or failed lines), in input order. "
        "Progress is kept in a SQLite state file beside the output: killed at any moment and "
        "run again with the same arguments, the run continues where it stopped.",
    )
    add_batch_run_flags(run)
    add_engine_flags(
        engine_group(run),
        GENERATE_SETTINGS,
        defaults={"model": _demo_model_dir()},
        notes={"model": "default: the built-in demo model"},
    )
    run.set_defaults(func=_cmd_batch_run)


def _demo_model_dir() -> str:
    return str(Path(__file__).resolve().parent / "demo_model")


def _cmd_batch_run(args: argparse.Namespace) -> int:
    from qiao.batch.cli import run_batch

    if args.batch_invariant is None:
        # A resumed run must answer as the uninterrupted one would, whatever its steps hold.
        args.batch_invariant = True
    return run_batch(args, engine_kwargs(vars(args)))


def _cmd_serve(argv: list[str]) -> int:
    # No garbage collection while the server starts: importing torch and transformers and
    # loading a model ran five full collections of a growing heap, ~0.5 s of a 5 s start on 2
    # cores. run_server keeps it off while the models load, then freezes what start-up left.
    gc.disable()
    try:
        from qiao.api.settings import load_settings

        settings = load_settings(argv)
        settings.check_security()  # before loading torch and the model: refuse fast
        from qiao.api.server import run_server
    finally:
        gc.enable()
    run_server(settings)
    return 0


def _add_export_command(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="convert a model for another runtime: onnx",
        description="Convert a checkpoint into a version folder another backend serves.",
    )
    formats = export.add_subparsers(dest="format", required=True)
    onnx = formats.add_parser(
        "onnx",
        help="a BERT-family sentence encoder as an ONNX graph (backend: onnx)",
        description="Export a BERT-family sentence encoder, mean pooling and normalisation "
        "included, to ONNX with dynamic batch and sequence axes; check onnxruntime's outputs "
        "against PyTorch's; write a version folder (model.onnx, tokenizer, config, "
        "qiao_encoder.json) that the repository serves with `backend: onnx`.",
    )
    onnx.add_argument(
        "--model",
        required=True,
        type=Path,
        metavar="DIR",
        help="Hugging Face checkpoint directory of the encoder (config.json, model.safetensors, "
        "tokenizer.json; modules.json when it is a sentence-transformers model)",
    )
    onnx.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="version folder to write, e.g. REPO/MODEL/2; must be new or empty",
    )
    onnx.add_argument(
        "--opset",
        type=int,
        default=None,
        metavar="N",
        help="ONNX opset version (default: the exporter's)",
    )
    onnx.add_argument("--overwrite", action="store_true", help="replace --out when it is not empty")
    onnx.set_defaults(func=_cmd_export_onnx)


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from qiao.export.onnx import export_onnx

    report = export_onnx(args.model, args.out, opset=args.opset, overwrite=args.overwrite)
    shapes = ", ".join(f"{batch}x{seq}" for batch, seq in report.checked_shapes)
    print(
        f"check passed: max abs diff {report.max_abs_diff:.3g} (atol {report.atol:g}) "
        f"between onnxruntime and PyTorch on inputs {shapes}"
    )
    print(f"wrote {report.model_file} (opset {report.opset}) in {report.seconds:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qiao", description="qiao: LLM inference engine and server"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate text offline from prompts",
        description="Generate continuations for prompts (flags or one per stdin line).",
    )
    gen.add_argument(
        "--prompt", action="append", default=[], help="a prompt (repeatable); else stdin lines"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per sample")
    add_engine_flags(engine_group(gen), GENERATE_SETTINGS, required=["model"])
    _add_sampling_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (qiao serve --help lists every flag)",
        add_help=False,
    )
    bench = sub.add_parser(
        "bench",
        help="benchmarks: hw, throughput, latency, serve, quality, embeddings",
        description="Benchmarks that report against this machine's measured ceilings and, "
        "with --compare hf, beside Hugging Face transformers in the same run.",
    )
    add_bench_subcommands(bench)
    add_tune_command(sub)
    _add_export_command(sub)
    _add_batch_command(sub)
    add_repository_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            # `serve` owns its flags: one pydantic-settings schema (CLI, QIAO_* env, config file).
            return _cmd_serve(argv[1:])
        args = build_parser().parse_args(argv)
        resolve_engine_flags(args)
        # Progress of long work (loading weights, building kernels, exporting) goes to stderr.
        configure_logging(os.environ.get("QIAO_LOG_LEVEL", "info"), "qiao")
        return args.func(args)
    except QiaoError as exc:
        print(f"qiao: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
