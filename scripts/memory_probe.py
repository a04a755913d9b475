"""Native memory probe: does an engine's resident memory keep growing under varied load?

Runs the offline `LLM` on a model (the built-in demo model by default) for `--rounds` rounds of
`--prompts` random token prompts (random lengths, random `max_tokens`, `ignore_eos`), and reads
the process's RSS from /proc/self/statm after each round. The slope after the warm-up rounds
(least squares, MiB per round) is the figure to compare.

Each configuration runs in its own child process (environment variables such as
`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, `MALLOC_ARENA_MAX` or `LD_PRELOAD` must be set before the
process starts), one after the other, so one invocation compares them side by side:

    .venv/bin/python scripts/memory_probe.py --rounds 12 \
        --config bf16:dtype=bfloat16 \
        --config f32:dtype=float32 \
        --config cap0:dtype=bfloat16,ONEDNN_PRIMITIVE_CACHE_CAPACITY=0

The issue-18 before/after figures in docs/operations.md (soak section) came from:

    .venv/bin/python scripts/memory_probe.py --rounds 40 --warmup 20 --shapes \
        --config before:buckets=0 --config after:buckets=1

`--config NAME:KEY=VALUE,...`: `dtype=`, `repeat=1` (the same prompts every round: a round of
identical work), `buckets=0` (the linear layers' row buckets off, `linear_method.ROW_BUCKETS`:
every row count goes to oneDNN as it is, as before the fix), and any other KEY=VALUE is set in
the child's environment. Without `--config` one bfloat16 configuration runs. `--shapes` also
counts the distinct row counts the linear layers saw (M) and those their matmuls ran at (after
the buckets). Children run on one thread (`num_threads=1`) so a second core stays free.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "qiao" / "demo_model"


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def slope(values: list[float]) -> float:
    """Least-squares slope per step of `values` (0.0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def child(args: argparse.Namespace) -> None:
    import random

    from qiao import LLM, SamplingParams
    from qiao.layers import linear, linear_method

    linear_method.ROW_BUCKETS = not args.no_buckets
    shapes: set[int] = set()
    matmul_shapes: set[int] = set()
    if args.shapes:
        forward = linear.LinearBase.forward

        def counting(self, x):
            rows = x.reshape(-1, x.shape[-1]).shape[0]
            shapes.add(rows)
            matmul_shapes.add(linear_method.row_bucket(rows) if linear_method.ROW_BUCKETS else rows)
            return forward(self, x)

        linear.LinearBase.forward = counting

    llm = LLM(args.model, dtype=args.dtype, num_threads=1, profile=None)
    rng = random.Random(args.seed)

    def batch() -> tuple[list[dict], list[SamplingParams]]:
        prompts, params = [], []
        for _ in range(args.prompts):
            length = rng.randint(1, args.max_prompt)
            prompts.append({"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(length)]})
            params.append(
                SamplingParams(
                    max_tokens=rng.randint(1, args.max_tokens), ignore_eos=True, temperature=0.0
                )
            )
        return prompts, params

    fixed = batch() if args.repeat else None
    print(json.dumps({"round": -1, "rss_mib": rss_mib()}), flush=True)
    for i in range(args.rounds):
        prompts, params = fixed or batch()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        record = {"round": i, "rss_mib": rss_mib(), "s": time.perf_counter() - start}
        if args.shapes:
            record["distinct_m"] = len(shapes)
            record["distinct_matmul_m"] = len(matmul_shapes)
        print(json.dumps(record), flush=True)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    settings = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="rounds left out of the slope")
    parser.add_argument("--prompts", type=int, default=150)
    parser.add_argument("--max-prompt", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", action="store_true", help="the same prompts every round")
    parser.add_argument("--shapes", action="store_true", help="count distinct linear row counts")
    parser.add_argument("--config", action="append", default=[], metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--json", type=Path, help="write every configuration's rounds here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-buckets", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    configs = [parse_config(c) for c in args.config] or [("default", {})]
    results = {}
    for name, settings in configs:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--child", "--model", args.model]
        cmd += ["--rounds", str(args.rounds), "--prompts", str(args.prompts)]
        cmd += ["--max-prompt", str(args.max_prompt), "--max-tokens", str(args.max_tokens)]
        cmd += ["--seed", str(args.seed)]
        dtype = args.dtype
        for key, value in settings.items():
            if key == "dtype":
                dtype = value
            elif key == "repeat":
                cmd += ["--repeat"] if value not in ("0", "") else []
            elif key == "buckets":
                cmd += ["--no-buckets"] if value in ("0", "") else []
            else:
                env[key] = value
        if args.repeat and "repeat" not in settings:
            cmd.append("--repeat")
        if args.shapes:
            cmd.append("--shapes")
        cmd += ["--dtype", dtype]
        rounds = []
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            rounds.append(record)
            extra = ""
            if "distinct_m" in record:
                extra = (
                    f" distinct M {record['distinct_m']} (matmuls {record['distinct_matmul_m']})"
                )
            took = f" ({record['s']:.1f} s)" if "s" in record else ""
            print(
                f"[{name}] round {record['round']:>3}: {record['rss_mib']:7.1f} MiB{extra}{took}",
                flush=True,
            )
        if proc.wait() != 0:
            raise SystemExit(f"{name}: child exited {proc.returncode}")
        results[name] = {"settings": settings, "rounds": rounds}

    print(f"\nMiB per round after {args.warmup} warm-up rounds (least squares):")
    for name, result in results.items():
        rss = [r["rss_mib"] for r in result["rounds"] if r["round"] >= args.warmup]
        first, last = result["rounds"][0]["rss_mib"], result["rounds"][-1]["rss_mib"]
        print(f"  {name:<16} {slope(rss):6.2f} MiB/round   start {first:.0f} -> end {last:.0f} MiB")
        result["slope_mib_per_round"] = slope(rss)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
