"""Offline throughput at tensor_parallel_size 1 and N on one machine, side by side.

Each setting runs in its own process (a fresh torch.distributed group), alternating, --repeat
times; the figure is the median. With a shape (random weights), every rank draws its own slice,
so the text is noise: the run measures speed only (ignore_eos, fixed lengths).

    .venv/bin/python scripts/bench_tensor_parallel.py --shape qwen2.5-0.5b --sizes 1,2 \\
        --threads 2,1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_RUN = """
import json, sys, time
from qiao import LLM, SamplingParams
model, size, threads, prompts, input_len, output_len = sys.argv[1], *map(int, sys.argv[2:7])
llm = LLM(model, load_format="dummy", profile=None, num_threads=threads,
          tensor_parallel_size=size, skip_tokenizer_init=True, max_model_len=input_len + output_len)
batch = [{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(input_len)]} for i in range(prompts)]
params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
llm.generate(batch[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
start = time.perf_counter()
llm.generate(batch, params, use_tqdm=False)
seconds = time.perf_counter() - start
print(json.dumps({"output_tok_s": prompts * output_len / seconds, "seconds": seconds}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values")
    parser.add_argument("--threads", default="2,1", help="torch threads per rank, per size")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from qiao.bench.shapes import write_shape_dir

    sizes = [int(x) for x in args.sizes.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    runs: dict[str, list[float]] = {f"tp{s}x{t}": [] for s, t in zip(sizes, threads, strict=True)}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_shape_dir(args.shape, Path(tmp) / args.shape)
        for _ in range(args.repeat):
            for size, n in zip(sizes, threads, strict=True):
                argv = [str(model), str(size), str(n), str(args.num_prompts)]
                argv += [str(args.input_len), str(args.output_len)]
                done = subprocess.run(
                    [sys.executable, "-c", _RUN, *argv], capture_output=True, text=True
                )
                if done.returncode:
                    raise SystemExit(done.stderr[-3000:])
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[f"tp{size}x{n}"].append(result["output_tok_s"])
    report = {
        "shape": args.shape,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "runs": runs,
        "medians": {k: statistics.median(v) for k, v in runs.items()},
    }
    for key, value in report["medians"].items():
        print(f"{key}: {value:.1f} output tok/s (runs {', '.join(f'{v:.1f}' for v in runs[key])})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
