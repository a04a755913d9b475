"""Screenshots of the web console (docs/console/*.png), taken by its browser tests.

    .venv/bin/python scripts/console_screenshots.py [--out docs/console]

Runs tests/serving/test_console.py (a real `qiao serve` on the demo model, Debian's chromium
through Playwright) with QIAO_CONSOLE_SCREENSHOTS pointing at `--out`, so the pictures show what
the tests checked: the playground after a streamed answer with logprobs, the dashboard under
load with a batch job, the management listener's models page after a reload and a traffic
change. Then each PNG is re-encoded with a 256-colour palette (Pillow), which keeps it small.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("playground.png", "dashboard.png", "models.png")


def shrink(path: Path) -> None:
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "console")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "QIAO_CONSOLE_SCREENSHOTS": str(out)}
    test = ROOT / "tests" / "serving" / "test_console.py"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", str(test)], env=env, cwd=ROOT)
    if result.returncode != 0:
        return result.returncode
    for name in NAMES:
        path = out / name
        before = path.stat().st_size
        shrink(path)
        print(
            f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
            f"{before // 1024} KiB -> {path.stat().st_size // 1024} KiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
