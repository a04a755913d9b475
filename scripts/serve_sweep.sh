#!/usr/bin/env bash
# Serving benchmark on a built-in model shape (random weights): start `qiao serve` on 127.0.0.1,
# wait for its KV pool to be resident, sweep open-loop Poisson request rates with
# `qiao bench serve`, write the JSON report and the latency-vs-rate plot, stop the server.
#
#   scripts/serve_sweep.sh [OUTDIR]          (default docs/results)
#
# Environment knobs (defaults in brackets): SHAPE [smollm2-135m], RATES [1.2,1.3,1.4],
# PROMPTS per run [300], REPEAT runs per rate, each with its own arrivals, the report giving
# their medians [3; three rates take ~40 min on 2 cores], INPUT_LEN [128], OUTPUT_LEN [128],
# SERVE_ARGS (extra `qiao serve` flags) [--max-num-batched-tokens 80: the budget
# `qiao tune --itl-slo 0.25` picks for the 135M shape on a 2-core machine, a full step at ~80 %
# of the 250 ms ITL SLO], PORT [8731].
# Requests sample greedily (--temperature 0), as the offline `qiao bench throughput` does.
# The shape has no tokenizer of its own; the script writes a word-level one (see below).
set -euo pipefail
cd "$(dirname "$0")/.."

OUTDIR=${1:-docs/results}
SHAPE=${SHAPE:-smollm2-135m}
RATES=${RATES:-1.2,1.3,1.4}
PROMPTS=${PROMPTS:-300}
REPEAT=${REPEAT:-3}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
SERVE_ARGS=${SERVE_ARGS:---max-num-batched-tokens 80}
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
# The shape's config.json plus a word-level tokenizer over its whole vocabulary (see
# write_word_tokenizer: the load generator's words first, then filler words).
import sys
from qiao.bench.common import WORDS
from qiao.bench.shapes import write_shape_dir, write_word_tokenizer
write_word_tokenizer(write_shape_dir(sys.argv[1], sys.argv[2]), list(WORDS))
EOF

START=$(date +%s%N)
# shellcheck disable=SC2086
.venv/bin/qiao serve --model "$MODEL_DIR" --served-model-name "$SHAPE" --load-format dummy \
    --dtype float32 --host 127.0.0.1 --port "$PORT" --no-profile $SERVE_ARGS \
    > "$OUTDIR/serve_sweep_server.log" 2>&1 &
SERVER_PID=$!

READY_URL="http://127.0.0.1:$PORT/health/ready"
for attempt in $(seq 1 600); do
    if "$PY" -c "import urllib.request; urllib.request.urlopen('$READY_URL', timeout=1)" 2>/dev/null; then
        break
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited; see $OUTDIR/serve_sweep_server.log" >&2; exit 1; }
    [ "$attempt" -lt 600 ] || { echo "server not ready after 60 s" >&2; exit 1; }
    sleep 0.1
done
READY=$(( ($(date +%s%N) - START) / 1000000 ))
echo "server ready after ${READY} ms (process start to /health/ready answering 200; includes the readiness poll, <= 0.2 s late)" | tee "$OUTDIR/serve_ready.txt"

# Steady state: load starts once the server logs its KV pool resident (faulted in by a background
# thread from the moment the engine is built, 8-20 s after ready on 2 cores; load arriving while
# it runs slows both). QIAO_KV_PREFAULT=0 servers never log it: 60 s at most.
for attempt in $(seq 1 600); do
    grep -q "KV pool resident" "$OUTDIR/serve_sweep_server.log" && break
    sleep 0.1
done

.venv/bin/qiao bench serve --base-url "http://127.0.0.1:$PORT" --request-rates "$RATES" \
    --num-prompts "$PROMPTS" --repeat "$REPEAT" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --temperature 0 --slo-ttft 2.0 --slo-itl 0.25 \
    --json "$OUTDIR/serve_$SHAPE.json" --plot "$OUTDIR/serve_$SHAPE.png"
