"""The device qiao runs on: its kind, the dtypes it computes in, and its memory."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import platform as _host
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qiao.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Platform:
    """The accelerator (or CPU) a process computes on."""

    device_type: str  # "cuda" or "cpu"
    device_name: str

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"


@functools.cache
def current_platform() -> Platform:
    if torch.cuda.is_available():
        return Platform("cuda", torch.cuda.get_device_name())
    return Platform("cpu", _host.processor() or _host.machine())


def default_device() -> torch.device:
    return torch.device(current_platform().device_type)


def resolve_dtype(
    name: str, config_dtype: str | None, device_type: str | None = None
) -> torch.dtype:
    """Map the `dtype` setting to a torch dtype on `device_type` (default: this platform's).

    "auto" takes the checkpoint's own dtype (`torch_dtype` in config.json), float32 when unset,
    except that on the CPU a half-precision checkpoint (bfloat16 or float16) runs in the CPU's
    fast path: bfloat16 where the CPU multiplies it natively (AMX, AVX-512 BF16), else float32
    (emulated bfloat16 and float16 matmuls are slower than float32 there). A float32
    checkpoint stays float32: its precision is what it asked for.
    """
    if name == "auto":
        if config_dtype is None:
            return torch.float32
        dtype = _lookup(config_dtype.removeprefix("torch."), "torch_dtype")
        on_cpu = (device_type or current_platform().device_type) == "cpu"
        if on_cpu and dtype in (torch.bfloat16, torch.float16):
            return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
        return dtype
    return _lookup(name, "dtype")


@functools.cache
def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX-512 BF16 dot products),
    which makes bfloat16 its fastest floating-point matmul (about 2x float32 with AVX-512 BF16,
    about 7x with AMX)."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def _lookup(name: str, field: str) -> torch.dtype:
    if name not in DTYPES:
        allowed = ", ".join(["auto", *DTYPES])
        raise ConfigError(f"{field}: unsupported value {name!r}; allowed: {allowed}")
    return DTYPES[name]


def to_device_async(
    array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A host array as a tensor on `device`, without making the host wait for the device.

    The cast happens on the host (a cast inside a host-to-device copy would restage it in
    pageable memory). On CUDA the array is staged in pinned memory, whose caching allocator
    holds it until the asynchronous copy has read it; a copy from pageable memory may block on
    the work already queued.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        tensor = tensor.to(dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def total_memory_bytes(device: torch.device) -> int:
    """Physical memory of `device` (system RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _meminfo_bytes("MemTotal")


def available_memory_bytes(device: torch.device) -> int:
    """Memory `device` can still hand out now (MemAvailable for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _meminfo_bytes("MemAvailable")


def _meminfo_bytes(key: str) -> int:
    # Lines read like "MemTotal:       24531208 kB".
    for line in _MEMINFO.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"{key} not found in {_MEMINFO}")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU its pages come zeroed from the OS on first touch (an
    anonymous mapping), so a large KV pool costs nothing until used, instead of a full memset at
    start; the mapping asks for transparent huge pages, so first touches fault 2 MiB at a time
    rather than 4 KiB (with 4 KiB pages, the faults of fresh KV blocks cost 10 % of a serving
    step)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: a shared anonymous mapping is shmem, which takes huge pages only where the
    # host's shmem_enabled allows (often "never"); a private one follows the madvise below.
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Without transparent huge pages here: 4 KiB pages, same contents.
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    # The numpy array holds the mapping alive, and the tensor holds the array.
    raw = np.frombuffer(mapping, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


# madvise(2) advice: fault a range in writable without touching it (Linux 5.14+).
_MADV_POPULATE_WRITE = 23


def prefault_in_background(
    tensors: Sequence[torch.Tensor], ranges: Sequence[tuple[int, int, int]], what: str = "memory"
) -> threading.Thread | None:
    """Fault in CPU memory that `zeros` mapped lazily, on a background thread, so that later
    first writes to it never stop for page faults. Returns the thread; None off Linux.

    `ranges` are (tensor index, byte offset, byte length), populated in the order given (put
    what is used first, first). The thread holds the tensors weakly and stops once one is
    freed, or at the first range the kernel refuses (no MADV_POPULATE_WRITE before Linux
    5.14); it logs the size and time once done.

    All of it at once, at normal priority, not paced with use: on a VM whose host backs guest
    memory lazily, a fresh 2 MiB page costs ~3 ms of a core (2 GiB: 6 s here), and with the pool
    faulted in just ahead of use (256 MiB ahead, nice 10) a fresh 135M-model server's steps ran
    ~10-17 % slower for the minutes its first pass through a 2.4 GiB pool took; faulted in before
    the load came, they ran at warm speed from the first (README, "Where the time goes").
    """
    if not tensors or _host.system() != "Linux":
        return None
    refs = [weakref.ref(t) for t in tensors]
    thread = threading.Thread(
        target=_prefault, args=(refs, ranges, what), name="qiao-prefault", daemon=True
    )
    thread.start()
    return thread


def _prefault(
    refs: list[weakref.ref[torch.Tensor]], ranges: Sequence[tuple[int, int, int]], what: str
) -> None:
    libc = ctypes.CDLL(None, use_errno=True)  # calls through it release the GIL
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start_time = time.monotonic()
    done = 0
    for index, offset, length in ranges:
        tensor = refs[index]()
        if tensor is None:
            return  # freed: nothing left worth faulting in
        start = tensor.data_ptr() + offset
        aligned = start - start % page
        if madvise(aligned, start + length - aligned, _MADV_POPULATE_WRITE) != 0:
            logger.debug("%s prefault stopped: %s", what, os.strerror(ctypes.get_errno()))
            return
        del tensor
        done += length
    logger.info(
        "%s resident: %.0f MiB faulted in, %.1f s",
        what,
        done / 2**20,
        time.monotonic() - start_time,
    )
