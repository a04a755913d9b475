"""Fused CPU kernels (C++), built once per machine on first use and cached.

`cpu_ops()` returns the compiled module, or None when it cannot be built (no compiler) or is
disabled with QIAO_DISABLE_CPU_KERNELS=1; callers then use the plain-PyTorch reference, which is
also the kernels' test oracle. A CPU engine asks for them while it loads (`LLMEngine`), so a
first build (about a minute on 2 cores) happens before a server reports ready, not inside its
first request.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from qiao import envs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
# One build at a time: the engine asks from a loader thread while other code may ask too. Once
# loaded, callers (every layer, every step) read _ops without taking the lock.
_BUILD_LOCK = threading.Lock()
_NOT_LOADED = object()
_ops: ModuleType | object | None = _NOT_LOADED


def cpu_ops() -> ModuleType | None:
    global _ops
    if _ops is _NOT_LOADED:
        with _BUILD_LOCK:
            if _ops is _NOT_LOADED:
                _ops = _load()
    return _ops  # type: ignore[return-value]


def _load() -> ModuleType | None:
    if envs.disable_cpu_kernels():
        return None
    try:
        return _build()
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why once
        logger.warning("CPU kernels unavailable, using the PyTorch reference ops (%s)", exc)
        return None


def ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when `tensor` lives on the CPU and they are available, else None."""
    return cpu_ops() if tensor.device.type == "cpu" else None


def _build() -> ModuleType:
    import torch
    from torch.utils import cpp_extension

    source = _SOURCE.read_bytes()
    # One build per source text and place, torch version and machine (the code is built for
    # this CPU). The place, since torch's build file names the source's path: two checkouts
    # sharing a directory rebuilt it (a minute each, silently) every time either was used.
    ident = source + str(_SOURCE.resolve()).encode() + torch.__version__.encode() + _cpu_id()
    key = hashlib.sha256(ident).hexdigest()[:16]
    build_dir = envs.cache_dir() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not (build_dir / "qiao_cpu_ops.so").exists()
    if fresh:
        logger.info(
            "building the C++ CPU kernels for this machine into %s (once per machine and "
            "version; about a minute on 2 cores)",
            build_dir,
        )
    started = time.monotonic()
    module = cpp_extension.load(
        name="qiao_cpu_ops",
        sources=[str(_SOURCE)],
        build_directory=str(build_dir),
        extra_cflags=[
            "-O3",
            "-march=native",
            "-mprefer-vector-width=512",
            "-fopenmp",
            "-fno-math-errno",
        ],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    if fresh:
        logger.info("built the C++ CPU kernels in %.0f s", time.monotonic() - started)
    return module


# /proc/cpuinfo flags naming instruction-set extensions, the ones -march=native builds for. The
# others (mitigations, hypervisor and power-management bits) change under a VM without changing
# what code runs here; keyed on the whole line, the build cache missed twice in one day on this
# machine and a server start waited a minute for the compiler.
_ISA_FLAG = re.compile(
    r"^(sse|ssse|avx|fma|f16c|bmi|abm|lzcnt|popcnt|movbe|aes|pclmul|vpclmul|vaes|gfni|sha|adx"
    r"|rdrand|rdseed|cx16|xsave|clflushopt|clwb|amx|movdir|serialize|prefetchw|3dnowprefetch"
    r"|tbm|xop|waitpkg|cldemote|ptwrite|rdpid|wbnoinvd|pku|ospke|lm$)"
)


def _cpu_id(cpuinfo: str | None = None) -> bytes:
    """The instruction-set extensions of this CPU (`cpuinfo`: /proc/cpuinfo's text), sorted:
    on x86 the flags _ISA_FLAG names, on Arm every listed feature."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return b""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return " ".join(sorted(f for f in value.split() if _ISA_FLAG.match(f))).encode()
        if name.strip() == "Features":
            return " ".join(sorted(value.split())).encode()
    return b""
