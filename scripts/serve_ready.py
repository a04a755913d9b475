"""Time `qiao serve` from process start to `/health/ready` answering 200, on a built-in shape.

    .venv/bin/python scripts/serve_ready.py [--shape smollm2-135m] [--repeat 3] [-- SERVE ARGS]

Random (dummy) float32 weights, a word-level tokenizer over the shape's vocabulary, no tuning
profile. The readiness poll runs in this process every 20 ms (no interpreter started per poll,
which would compete with the server for the CPU). Prints each start and the median, and where
the server's own log says the time went.
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from qiao.bench.common import WORDS
from qiao.bench.shapes import SHAPES, write_shape_dir, write_word_tokenizer

QIAO = Path(sys.executable).with_name("qiao")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(model_dir: Path, shape: str, extra: list[str], log: Path) -> float:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health/ready"
    command = [
        str(QIAO), "serve", "--model", str(model_dir), "--served-model-name", shape,
        "--load-format", "dummy", "--dtype", "float32", "--port", str(port), "--no-profile",
        "--log-interval", "0", *extra,
    ]  # fmt: skip
    started = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=1) as response:
                        if response.status == 200:
                            return time.perf_counter() - started
                except OSError:
                    pass
                if process.poll() is not None:
                    raise SystemExit(f"qiao serve exited; its log:\n{log.read_text()[-2000:]}")
                if time.perf_counter() - started > 120:
                    raise SystemExit("qiao serve not ready after 120 s")
                time.sleep(0.02)
        finally:
            process.terminate()
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--repeat", type=int, default=3, help="starts to time (default 3)")
    parser.add_argument("serve_args", nargs="*", help="more `qiao serve` flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp) / args.shape)
        write_word_tokenizer(model_dir, list(WORDS))
        times = []
        for i in range(args.repeat):
            log = Path(tmp) / f"serve-{i}.log"
            times.append(start_once(model_dir, args.shape, args.serve_args, log))
            loaded = re.search(r"set up in ([\d.]+) s", log.read_text())
            print(
                f"start {i + 1}: ready after {times[-1]:.2f} s"
                + (f" (model set up in {loaded.group(1)} s)" if loaded else "")
            )
    print(f"median: {statistics.median(times):.2f} s over {len(times)} starts")


if __name__ == "__main__":
    main()
