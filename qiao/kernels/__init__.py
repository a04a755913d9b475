"""Fused CPU kernels (C++), built once per machine and cached; a finished build loads directly.

`cpu_ops()` returns the compiled module, or None when it cannot be had (no compiler, a build
that failed or timed out) or is disabled with QIAO_DISABLE_CPU_KERNELS=1; callers then use the
plain-PyTorch reference, which is also the kernels' test oracle. A CPU engine asks for them while
it loads (`LLMEngine`), so a first build (about a minute on 2 cores) happens before a server
reports ready, not inside its first request. `./dev setup` (`python -m qiao.kernels`) builds them
once ahead of any start.

A start never waits silently:

- A finished build (its `COMPLETE` record naming the library's digest) is imported directly:
  no compiler, no ninja, no lock.
- A build runs under an `fcntl.flock` on `build.lock` in its cache folder, which the kernel
  releases when its holder dies (killed, crashed, out of memory). A start that finds it held
  says whose it is and waits at most QIAO_KERNEL_BUILD_TIMEOUT seconds, then gives up with an
  error naming the lock (and falls back to the reference ops). torch's own build lock, which a
  killed build leaves behind and which torch waits on forever, is cleared under ours.
- One toolchain builds: the compiler torch picks (`CXX`, else `c++`) and the ninja installed
  beside this Python ahead of any other on PATH. Before, two ninja binaries on PATH alternated
  torch's build-command hash and every change of PATH rebuilt the kernels (a minute).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from qiao import envs
from qiao.logs import heartbeat

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
_NAME = "qiao_cpu_ops"
_CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno"]
_LDFLAGS = ["-fopenmp"]
# One build at a time in this process: the engine asks from a loader thread while other code may
# ask too. Once loaded, callers (every layer, every step) read _ops without taking the lock.
_BUILD_LOCK = threading.Lock()
_NOT_LOADED = object()
_ops: ModuleType | object | None = _NOT_LOADED


class KernelBuildTimeout(RuntimeError):
    """Another process held the build lock past QIAO_KERNEL_BUILD_TIMEOUT."""


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
        return load_or_build(_NAME, _SOURCE, _CFLAGS, _LDFLAGS)
    except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why once
        logger.warning("CPU kernels unavailable, using the PyTorch reference ops (%s)", exc)
        return None


def ops_for(tensor: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when `tensor` lives on the CPU and they are available, else None."""
    return cpu_ops() if tensor.device.type == "cpu" else None


def build_dir_for(source: Path, cflags: list[str]) -> Path:
    """The cache folder of one build: per source text and place, flags, torch version and CPU.

    The place, since torch's build file names the source's path: two checkouts sharing a
    directory rebuilt it (a minute each, silently) every time either was used."""
    import torch

    ident = b"\0".join(
        [
            source.read_bytes(),
            str(source.resolve()).encode(),
            " ".join(cflags).encode(),
            torch.__version__.encode(),
            _cpu_id(),
        ]
    )
    return envs.cache_dir() / "kernels" / hashlib.sha256(ident).hexdigest()[:16]


def load_or_build(
    name: str,
    source: Path,
    cflags: list[str],
    ldflags: list[str],
    timeout: float | None = None,
) -> ModuleType:
    """The extension `name` built from `source`: imported from a finished build, else built
    (under the build lock, waiting at most `timeout` s for another builder) and imported."""
    build_dir = build_dir_for(source, cflags)
    module = _import_complete(build_dir, name)
    if module is not None:
        return module
    build_dir.mkdir(parents=True, exist_ok=True)
    limit = envs.kernel_build_timeout() if timeout is None else timeout
    with _flock(build_dir / "build.lock", limit):
        module = _import_complete(build_dir, name)  # finished while this start waited
        if module is not None:
            return module
        return _build(name, source, cflags, ldflags, build_dir)


def _import_complete(build_dir: Path, name: str) -> ModuleType | None:
    """Import a finished build (its record names the library's digest), or None."""
    library = build_dir / f"{name}.so"
    try:
        record = json.loads((build_dir / "COMPLETE").read_text())
        data = library.read_bytes()
    except (OSError, ValueError):
        return None
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        logger.warning("the kernel build in %s is incomplete or changed; rebuilding", build_dir)
        return None
    import torch  # noqa: F401  (the library links against libtorch, loaded by this import)

    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@contextlib.contextmanager
def _flock(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (released by the kernel if this process dies); wait
    at most `timeout` s for another holder, logging whose lock it is."""
    with open(path, "a+") as lock:
        started = time.monotonic()
        next_log = started + 1.0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                holder = _lock_holder(path)
                if now - started >= timeout:
                    raise KernelBuildTimeout(
                        f"another process ({holder}) has held the kernel build lock {path} for "
                        f"over {timeout:.0f} s: wait for it to finish, stop it, or raise "
                        "QIAO_KERNEL_BUILD_TIMEOUT (QIAO_DISABLE_CPU_KERNELS=1 skips the kernels)"
                    ) from None
                if now >= next_log:
                    logger.info(
                        "waiting for the C++ kernel build of another process (%s; lock %s, "
                        "%.0f s of at most %.0f s)",
                        holder,
                        path,
                        now - started,
                        timeout,
                    )
                    next_log = now + 30.0
                time.sleep(0.1)
        try:
            lock.seek(0)
            lock.truncate()
            lock.write(json.dumps({"pid": os.getpid(), "since": time.time()}))
            lock.flush()
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock_holder(path: Path) -> str:
    try:
        pid = json.loads(path.read_text())["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"
    return f"pid {pid}"


def _build(
    name: str, source: Path, cflags: list[str], ldflags: list[str], build_dir: Path
) -> ModuleType:
    """Build in `build_dir/work` (the caller holds the build lock), then publish the library
    and its COMPLETE record for later starts."""
    from torch.utils import cpp_extension

    work = build_dir / "work"
    work.mkdir(exist_ok=True)
    # torch's own lock: a killed build leaves it, and torch waits on it forever. Ours is held.
    (work / "lock").unlink(missing_ok=True)
    logger.info(
        "building the C++ CPU kernels for this machine into %s (once per machine and version; "
        "about a minute on 2 cores)",
        build_dir,
    )
    started = time.monotonic()
    # A compiler shows no progress of its own: a line every 15 s says the start is building.
    with _pinned_ninja(), heartbeat(logger, "building the C++ CPU kernels", every=15.0):
        module = cpp_extension.load(
            name=name,
            sources=[str(source)],
            build_directory=str(work),
            extra_cflags=cflags,
            extra_ldflags=ldflags,
            verbose=False,
        )
    _publish(work / f"{name}.so", build_dir, name)
    logger.info("built the C++ CPU kernels in %.0f s", time.monotonic() - started)
    return module


@contextlib.contextmanager
def _pinned_ninja() -> Iterator[None]:
    """The ninja installed beside this Python (a dependency of qiao) first on PATH."""
    here = Path(sys.executable).parent
    if not (here / "ninja").exists():
        yield
        return
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(here), previous])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def _publish(built: Path, build_dir: Path, name: str) -> None:
    """Copy the library next to the work folder and record its digest, each atomically."""
    data = built.read_bytes()
    target = build_dir / f"{name}.so"
    partial = build_dir / f".{name}.so.partial"
    partial.write_bytes(data)
    os.replace(partial, target)
    compiler = os.environ.get("CXX", "c++")
    record = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "compiler": shutil.which(compiler) or compiler,
        "built_at": time.time(),
    }
    partial = build_dir / ".COMPLETE.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, build_dir / "COMPLETE")


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
