"""Tensor-parallel ranks 1..N-1: worker processes that rank 0's `ModelRunner` drives.

Rank 0 is the engine's own runner. It starts one worker process per other rank
(`python -m qiao.runner.tensor_parallel`, the runner's arguments as JSON on stdin), and all join
one torch.distributed group (gloo on the CPU, NCCL on CUDA) before any rank builds its model, so
every parallel layer knows its slice. Each worker loads its slice of the checkpoint and then
follows rank 0 step by step: rank 0 broadcasts a fixed-size header (a command and its sizes),
then the command's data as one int64 tensor, and every rank runs the same forward or logits
call, meeting in the layers' collectives. Only rank 0 samples.

Commands: KV (allocate the cache: blocks, block size), FORWARD (a step's flat layout: token
ids, positions, slots, query starts, sequence lengths, block tables), LOGITS (the hidden rows
of the last forward to compute logits of), STOP. A worker whose rank 0 goes away meets a broken
connection in its next broadcast and exits; rank 0 stops its workers when it closes (or exits).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qiao.distributed.parallel_state import (
    broadcast,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from qiao.errors import ConfigError

logger = logging.getLogger(__name__)

HEADER = 8
STOP, KV, FORWARD, LOGITS = 0, 1, 2, 3
# How long a rank waits for its peers to join, and then for each collective.
JOIN_TIMEOUT_S = 600.0


@dataclass
class StepLayout:
    """One step's flat batch as host arrays: what rank 0 sends and every rank runs."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [S + 1]
    seq_lens: np.ndarray  # [S]
    block_tables: np.ndarray  # [S, B]

    def pack(self) -> tuple[list[int], torch.Tensor]:
        t, (s, b) = len(self.input_ids), self.block_tables.shape
        parts = [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables.reshape(-1),
        ]
        return [t, s, b], torch.from_numpy(np.concatenate(parts).astype(np.int64))

    @classmethod
    def unpack(cls, sizes: list[int], data: torch.Tensor) -> StepLayout:
        t, s, b = sizes
        flat = data.numpy()
        bounds = np.cumsum([t, t, t, s + 1, s])
        ids, pos, slots, qsl, lens, tables = np.split(flat, bounds)
        return cls(ids, pos, slots, qsl, lens, tables.reshape(s, b))


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPDriver:
    """Rank 0's side: starts the workers, joins the group, and sends them each command."""

    def __init__(self, size: int, runner_args: dict[str, Any], device: torch.device) -> None:
        self.size = size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        backend = _backend(device)
        self.workers: list[subprocess.Popen] = []
        for rank in range(1, size):
            spec = {
                "rank": rank,
                "size": size,
                "init_method": init_method,
                "backend": backend,
                "num_threads": torch.get_num_threads(),
                "runner": runner_args,
            }
            worker = subprocess.Popen(
                [sys.executable, "-m", "qiao.runner.tensor_parallel"], stdin=subprocess.PIPE
            )
            assert worker.stdin is not None
            worker.stdin.write(json.dumps(spec).encode())
            worker.stdin.close()
            self.workers.append(worker)
        atexit.register(self.close)
        logger.info("tensor parallel: %d ranks (%s), workers %s", size, backend, self.pids)
        init_tensor_parallel(0, size, init_method, backend, timeout_s=JOIN_TIMEOUT_S)
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def _send(self, command: int, sizes: list[int], data: torch.Tensor | None = None) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = command
        header[1 : 1 + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
        broadcast(header)
        if data is not None:
            broadcast(data)

    def init_kv(self, num_blocks: int, block_size: int) -> None:
        self._send(KV, [num_blocks, block_size])

    def forward(self, layout: StepLayout) -> None:
        sizes, data = layout.pack()
        self._send(FORWARD, sizes, data)

    def logits(self, rows: torch.Tensor) -> None:
        data = rows.to(device="cpu", dtype=torch.int64)
        self._send(LOGITS, [len(data)], data)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a worker gone already: nothing left to tell
            self._send(STOP, [])
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        destroy_tensor_parallel()


def _worker_main() -> int:
    """A worker rank: join the group, build this rank's runner, follow rank 0 until STOP."""
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=os.environ.get("QIAO_LOG_LEVEL", "WARNING"))
    torch.set_num_threads(spec["num_threads"])
    init_tensor_parallel(
        spec["rank"],
        spec["size"],
        spec["init_method"],
        spec["backend"],
        timeout_s=JOIN_TIMEOUT_S,
    )
    from qiao.runner.model_runner import ModelRunner

    runner = ModelRunner.for_worker(spec["runner"])
    try:
        _follow(runner)
    except (RuntimeError, ConnectionError) as exc:  # gloo/NCCL: a peer closed its end
        logger.error("tensor parallel rank %d: rank 0 is gone (%s); exiting", spec["rank"], exc)
        return 1
    destroy_tensor_parallel()
    return 0


def _follow(runner: Any) -> None:
    """Run rank 0's commands until STOP."""
    hidden: torch.Tensor | None = None
    header = torch.zeros(HEADER, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            broadcast(header)
            command, *sizes = header.tolist()
            if command == STOP:
                break
            if command == KV:
                runner.init_kv_cache(sizes[0], sizes[1])
            elif command == FORWARD:
                t, s, b = sizes[:3]
                data = broadcast(torch.empty(3 * t + 2 * s + 1 + s * b, dtype=torch.int64))
                hidden = runner.forward_layout(StepLayout.unpack([t, s, b], data))
            elif command == LOGITS:
                rows = broadcast(torch.empty(sizes[0], dtype=torch.int64))
                if hidden is None:
                    raise ConfigError("tensor parallel: LOGITS before any FORWARD")
                runner.model.compute_logits(hidden[rows.to(hidden.device)])
            else:
                raise ConfigError(f"tensor parallel: unknown command {command}")


if __name__ == "__main__":
    sys.exit(_worker_main())
