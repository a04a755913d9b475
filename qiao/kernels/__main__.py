"""`python -m qiao.kernels`: find or build the C++ CPU kernels now and say which (`./dev setup`
runs it, so no later start waits for a compiler)."""

from __future__ import annotations

import logging
import sys
import time

from qiao import envs
from qiao.kernels import _CFLAGS, _NAME, _SOURCE, build_dir_for, cpu_ops


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[qiao] %(message)s", stream=sys.stdout)
    if envs.disable_cpu_kernels():
        print("[qiao] C++ CPU kernels: disabled (QIAO_DISABLE_CPU_KERNELS)")
        return 0
    started = time.monotonic()
    if cpu_ops() is None:
        print("[qiao] C++ CPU kernels: unavailable; the PyTorch reference ops will be used")
        return 0
    where = build_dir_for(_SOURCE, _CFLAGS) / f"{_NAME}.so"
    print(f"[qiao] C++ CPU kernels: ready in {time.monotonic() - started:.1f} s ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
