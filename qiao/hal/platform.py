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


def resolve_dtype(name: str, config_dtype: str | None) -> torch.dtype:
    """Map the `dtype` setting to a torch dtype.

    "auto" takes the checkpoint's own dtype (`torch_dtype` in config.json), float32 when unset.
    """
    if name == "auto":
        if config_dtype is None:
            return torch.float32
        return _lookup(config_dtype.removeprefix("torch."), "torch_dtype")
    return _lookup(name, "dtype")


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
_PREFAULT_NICE = 10


class PrefaultPacer:
    """How far a background prefault may run ahead of use. Ranges carry a position in the
    caller's unit (KV blocks, say); one at `position` goes ahead once `position < used + ahead`,
    and the user of the memory calls `advance(used)` as use grows.

    Faulting a whole pool at once costs a core for seconds (2.4 GiB: ~7 s here) and, under load,
    a tenth of one for over a minute even at nice 10: every step that long is slower. Paced,
    the same work spreads out with demand, and a pool that is never filled is never faulted in.
    """

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.waiting_at: int | None = None  # the position the prefault waits at, if it does
        self._used = 0
        self._cond = threading.Condition()

    def advance(self, used: int) -> None:
        if used > self._used:  # one writer; a stale read only delays the notify by a step
            with self._cond:
                self._used = used
                self._cond.notify_all()

    def wait_until_near(self, position: int, timeout: float) -> bool:
        """Wait until `position` is within `ahead` of use; False on timeout."""
        with self._cond:
            self.waiting_at = position
            near = self._cond.wait_for(lambda: position < self._used + self.ahead, timeout)
            self.waiting_at = None
            return near


def prefault_in_background(
    tensors: Sequence[torch.Tensor],
    ranges: Sequence[tuple[int, int, int, int]],
    pacer: PrefaultPacer | None = None,
) -> threading.Thread | None:
    """Fault in CPU memory that `zeros` mapped lazily, on a low-priority thread (nice 10: idle
    cores first, about a tenth of a busy one), so the first writes to it later do not stop for
    page faults.

    `ranges` are (tensor index, byte offset, byte length, position), populated in the order
    given (the order the memory will be used in); with a `pacer`, each waits until its position
    is near use. On a VM whose host backs guest memory lazily, a fresh 2 MiB page faults in
    ~5 ms, and a KV pool's K and V of every layer reach a new huge page in the same step: one
    step in ~40 stalls for ~0.3 s, which is a serving p99 latency. The thread holds the tensors
    weakly and stops once one is freed, or at the first range the kernel refuses (no
    MADV_POPULATE_WRITE before Linux 5.14). Returns the thread; None off Linux.
    """
    if not tensors or _host.system() != "Linux":
        return None
    refs = [weakref.ref(t) for t in tensors]
    thread = threading.Thread(
        target=_prefault, args=(refs, ranges, pacer), name="qiao-prefault", daemon=True
    )
    thread.start()
    return thread


def _prefault(
    refs: list[weakref.ref[torch.Tensor]],
    ranges: Sequence[tuple[int, int, int, int]],
    pacer: PrefaultPacer | None,
) -> None:
    # Not SCHED_IDLE: a server under steady load never leaves a core idle (its compute threads
    # spin between parallel regions), and the pool would fault in on the critical path anyway.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _PREFAULT_NICE)  # this thread
    libc = ctypes.CDLL(None, use_errno=True)  # calls through it release the GIL
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for index, offset, length, position in ranges:
        if pacer is not None:
            while not pacer.wait_until_near(position, timeout=1.0):
                if refs[index]() is None:
                    return  # freed while waiting for use to come near
        tensor = refs[index]()
        if tensor is None:
            return  # freed: nothing left worth faulting in
        start = tensor.data_ptr() + offset
        aligned = start - start % page
        if madvise(aligned, start + length - aligned, _MADV_POPULATE_WRITE) != 0:
            logger.debug("KV pool prefault stopped: %s", os.strerror(ctypes.get_errno()))
            return
        del tensor
