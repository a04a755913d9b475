#!/usr/bin/env bash
# The GPU check, for when a machine with an NVIDIA GPU is available (about 5 minutes on an H200,
# under 8 in the worst case: every step is time-limited, so one hang does not eat the budget):
#   1. picks a Python whose torch sees CUDA (.venv, then python3; else `./dev setup`, which
#      needs PyPI), and installs any wheels carried in .whl/ (a machine with no registry: pydantic
#      for python3.12 there, fetched with scripts/gpu_wheels.sh),
#   2. prints nvidia-smi and torch's CUDA facts,
#   3. runs the `gpu`-marked tests,
#   4. runs `qiao bench throughput` and `qiao bench latency` on CUDA with and without CUDA graphs
#      and prints graphs-on / graphs-off ratios.
# Everything goes to OUTDIR: gpu_check.log, four bench JSON files and summary.json.
#
#   scripts/gpu_check.sh [OUTDIR]        OUTDIR defaults to $OUT, else ./gpu-check-out
#
# Environment: QIAO_GPU_SHAPE (default qwen2.5-0.5b), QIAO_GPU_DTYPE (bfloat16), and the
# ceilings the benchmarks divide by, QIAO_GPU_CEILING_GFLOPS (790000) and QIAO_GPU_COPY_GBPS
# (4300): an H200's bf16 matmul rate and device copy bandwidth as measured there; the benches
# would otherwise measure the CPU's. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
SHAPE=${QIAO_GPU_SHAPE:-qwen2.5-0.5b}
DTYPE=${QIAO_GPU_DTYPE:-bfloat16}
CEILING=${QIAO_GPU_CEILING_GFLOPS:-790000}
COPY_GBPS=${QIAO_GPU_COPY_GBPS:-4300}
FAILED=0
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }

# step SECONDS NAME CMD...: run CMD under a time limit, log its output, count a failure.
step() {
  local limit=$1 name=$2 begin=$SECONDS rc
  shift 2
  say "--- $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    FAILED=$((FAILED + 1))
    [ "$rc" -eq 124 ] && say "$name: timed out after ${limit}s"
  fi
  say "$name: exit $rc after $((SECONDS - begin))s"
}

has_cuda() {
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

PY=
for candidate in .venv/bin/python python3; do
  if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then
    PY=$candidate
    break
  fi
done
if [ -z "$PY" ]; then
  say "no Python with a CUDA torch here; running ./dev setup (needs PyPI)"
  ./dev setup 2>&1 | tee -a "$LOG"
  PY=.venv/bin/python
  if ! has_cuda "$PY"; then
    say "torch in .venv does not see a GPU: nothing to check"
    exit 1
  fi
fi
# A machine with no package registry: wheels carried in .whl (pydantic and its needs, which
# the image lacks) go to a private folder on the path.
if compgen -G ".whl/*.whl" >/dev/null; then
  say "installing the carried wheels: $(cd .whl && echo *.whl)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/qiao-site .whl/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH="/tmp/qiao-site${PYTHONPATH:+:$PYTHONPATH}"
fi
# A system Python has no qiao installed: import it from this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The C++ kernels serve the CPU path only; their build is no part of this check.
export QIAO_DISABLE_CPU_KERNELS=1
say "python: $(command -v "$PY")"

device_facts() {
  nvidia-smi || echo "nvidia-smi not found"
  "$PY" - <<'EOF'
import torch

print("torch", torch.__version__, "CUDA", torch.version.cuda)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    print(
        f"cuda:{i} {p.name}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
        f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free), bf16 {torch.cuda.is_bf16_supported()}"
    )
EOF
}
export -f device_facts
export PY
step 30 "device facts" bash -c device_facts

mapfile -t GPU_TESTS < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
say "gpu-marked test files: ${GPU_TESTS[*]}"
step 150 "pytest -m gpu" "$PY" -m pytest -q -m gpu -p no:cacheprovider "${GPU_TESTS[@]}"

BENCH=("$PY" -m qiao.cli bench)
COMMON=(--shape "$SHAPE" --dtype "$DTYPE" --device cuda --repeat 3)
for mode in graphs eager; do
  flag=--cuda-graphs
  [ "$mode" = eager ] && flag=--no-cuda-graphs
  step 100 "throughput ($mode)" "${BENCH[@]}" throughput "${COMMON[@]}" "$flag" \
    --num-prompts 256 --input-len 128 --output-len 128 --max-num-seqs 128 \
    --ceiling-gflops "$CEILING" --json "$OUT_DIR/throughput-$mode.json"
  step 60 "latency ($mode)" "${BENCH[@]}" latency "${COMMON[@]}" "$flag" \
    --input-len 128 --batch-size 32 --decode-steps 64 \
    --copy-gbps "$COPY_GBPS" --json "$OUT_DIR/latency-$mode.json"
done

step 30 "summary" "$PY" - "$OUT_DIR" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None


summary = {}
# (bench, figure, label, whether more is better)
figures = [
    ("throughput", "output_tok_s", "output tok/s", True),
    ("latency", "decode_step_s_batch_1", "decode s/step, batch 1", False),
    ("latency", "decode_step_s_batch_n", "decode s/step, batch N", False),
    ("latency", "prefill_s_batch_n", "prefill s, batch N", False),
]
for bench, key, label, more_is_better in figures:
    on, off = load(f"{bench}-graphs.json"), load(f"{bench}-eager.json")
    if on is None or off is None:
        print(f"{label}: missing a run")
        continue
    speedup = on[key] / off[key] if more_is_better else off[key] / on[key]
    summary[f"{bench}.{key}"] = {"graphs": on[key], "eager": off[key], "speedup": speedup}
    print(f"{label:<24} graphs {on[key]:11.5g}  eager {off[key]:11.5g}  speedup {speedup:.2f}x")
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF

say "done: $FAILED failed step(s); outputs in $OUT_DIR"
exit "$FAILED"
