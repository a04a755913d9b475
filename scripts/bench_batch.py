"""`qiao batch run`'s runner against `LLM.generate` on the same prompts, in one process.

One engine (a built-in shape with random weights, or --model) serves both, in turn: A is
`LLM.generate(prompts, params)`; B is the batch runner (`qiao.batch.offline.OfflineBatch`) on
the same prompts written as `/v1/completions` lines, with everything `qiao batch run` does per
line: request checks, response assembly, the SQLite state (commits every second) and the final
output file. Medians of --runs; the ratio B / A is the figure (issue 20 asks for >= 0.9).

    .venv/bin/python scripts/bench_batch.py --shape smollm2-135m --num-prompts 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qiao.batch.lines import BatchLine
from qiao.batch.offline import OfflineBatch
from qiao.batch.results import write_lines_atomically
from qiao.batch.state import JobState
from qiao.bench.common import EngineArgs, LengthSpec, build_llm, make_workload, model_dir
from qiao.sampling_params import SamplingParams


def _lines(prompts: list[list[int]], output_lens: list[int]) -> list[BatchLine]:
    return [
        BatchLine(
            i + 1,
            f"req-{i}",
            "/v1/completions",
            {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True))
    ]


def _run_batch(llm: Any, lines: list[BatchLine], folder: Path) -> tuple[float, int]:
    state = JobState(folder / "state.sqlite", {"bench": True}, restart=True)
    batch = OfflineBatch(state.job_id, llm.engine, None)
    last = time.monotonic()

    def sink(line: BatchLine, ok: bool, record: dict[str, Any]) -> None:
        nonlocal last
        state.add(line.number, line.custom_id, ok, record)
        if time.monotonic() - last >= 1.0:
            state.commit()
            last = time.monotonic()

    start = time.perf_counter()
    batch.run(lines, sink)
    state.commit()
    write_lines_atomically(folder / "out.jsonl", (r for ok, r in state.records() if ok))
    seconds = time.perf_counter() - start
    _, failed = state.counts()
    state.remove()
    if failed:
        raise SystemExit(f"{failed} batch lines failed")
    return seconds, batch.generated_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", help="built-in shape (random weights)")
    parser.add_argument("--model", default=None, help="a checkpoint instead of --shape")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", default="64", help="tokens per prompt (N or LO:HI)")
    parser.add_argument("--output-len", default="64", help="tokens per answer (N or LO:HI)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    input_len, output_len = LengthSpec.parse(args.input_len), LengthSpec.parse(args.output_len)
    shape = None if args.model else args.shape
    with model_dir(args.model, shape) as path, tempfile.TemporaryDirectory() as tmp:
        engine_args = EngineArgs(
            load_format="dummy" if shape else "auto",
            dtype=args.dtype,
            quantization=None,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=2048,
            max_model_len=input_len.hi + output_len.hi,
        )
        llm = build_llm(path, engine_args)
        vocab = llm.engine.arch.vocab_size
        workload = make_workload(args.num_prompts, input_len, output_len, vocab, seed=0)
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            for n in workload.output_lens
        ]
        lines = _lines(workload.prompts, workload.output_lens)
        tokens = sum(workload.output_lens)
        llm.generate(workload.prompts[:4], params[:4], use_tqdm=False)  # warm-up
        generate_s, batch_s = [], []
        for run in range(args.runs):
            start = time.perf_counter()
            llm.generate(workload.prompts, params, use_tqdm=False)
            generate_s.append(time.perf_counter() - start)
            seconds, generated = _run_batch(llm, lines, Path(tmp))
            if generated != tokens:
                raise SystemExit(f"the batch generated {generated} tokens, expected {tokens}")
            batch_s.append(seconds)
            print(
                f"run {run + 1}: LLM.generate {generate_s[-1]:.2f} s, batch {seconds:.2f} s",
                file=sys.stderr,
            )
    report = {
        "model": args.model or args.shape,
        "num_prompts": args.num_prompts,
        "input_len": str(input_len),
        "output_len": str(output_len),
        "max_num_seqs": args.max_num_seqs,
        "generated_tokens": tokens,
        "generate_s": generate_s,
        "batch_s": batch_s,
        "generate_tok_s": tokens / statistics.median(generate_s),
        "batch_tok_s": tokens / statistics.median(batch_s),
    }
    report["batch_over_generate"] = report["batch_tok_s"] / report["generate_tok_s"]
    print(
        f"{tokens} tokens: LLM.generate {report['generate_tok_s']:.0f} tok/s, batch "
        f"{report['batch_tok_s']:.0f} tok/s (median of {args.runs}): batch / generate = "
        f"{report['batch_over_generate']:.3f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
