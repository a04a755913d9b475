#!/usr/bin/env bash
# Serving benchmark on a built-in model shape (random weights): start `qiao serve` on 127.0.0.1,
# sweep open-loop Poisson request rates with `qiao bench serve`, write the JSON report and the
# latency-vs-rate plot, stop the server.
#
#   scripts/serve_sweep.sh [OUTDIR]          (default docs/results)
#
# Environment knobs (defaults in brackets): SHAPE [smollm2-135m], RATES [0.25,0.5,0.75,1,1.25],
# PROMPTS per rate [48], INPUT_LEN [128], OUTPUT_LEN [128], SERVE_ARGS (extra `qiao serve`
# flags) [--max-num-batched-tokens 256], PORT [8731].
# The shape has no tokenizer of its own; the demo model's (4,096 ids, all valid in the shape's
# vocabulary) turns the benchmark's random words into tokens.
set -euo pipefail
cd "$(dirname "$0")/.."

OUTDIR=${1:-docs/results}
SHAPE=${SHAPE:-smollm2-135m}
RATES=${RATES:-0.25,0.5,0.75,1,1.25}
PROMPTS=${PROMPTS:-48}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
SERVE_ARGS=${SERVE_ARGS:---max-num-batched-tokens 256}
PORT=${PORT:-8731}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run ./dev setup first" >&2; exit 1; }

mkdir -p "$OUTDIR"
MODEL_DIR=$(mktemp -d -t "qiao-serve-$SHAPE-XXXX")
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$MODEL_DIR"
}
trap cleanup EXIT

"$PY" - "$SHAPE" "$MODEL_DIR" <<'EOF'
import shutil, sys
from pathlib import Path
import qiao
from qiao.bench.shapes import write_shape_dir
shape, target = sys.argv[1], Path(sys.argv[2])
write_shape_dir(shape, target)
demo = Path(qiao.__file__).parent / "demo_model"
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(demo / name, target / name)
EOF

START=$(date +%s%N)
# shellcheck disable=SC2086
.venv/bin/qiao serve --model "$MODEL_DIR" --served-model-name "$SHAPE" --load-format dummy \
    --dtype float32 --host 127.0.0.1 --port "$PORT" --no-profile $SERVE_ARGS \
    > "$OUTDIR/serve_sweep_server.log" 2>&1 &
SERVER_PID=$!

for _ in $(seq 1 120); do
    if "$PY" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
        break
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited; see $OUTDIR/serve_sweep_server.log" >&2; exit 1; }
    sleep 0.2
done
READY=$(( ($(date +%s%N) - START) / 1000000 ))
echo "server ready after ${READY} ms (process start to /health answering)" | tee "$OUTDIR/serve_ready.txt"

.venv/bin/qiao bench serve --base-url "http://127.0.0.1:$PORT" --request-rates "$RATES" \
    --num-prompts "$PROMPTS" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --slo-ttft 2.0 --slo-itl 0.25 \
    --json "$OUTDIR/serve_$SHAPE.json" --plot "$OUTDIR/serve_$SHAPE.png"
