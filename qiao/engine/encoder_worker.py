"""The encoder process: one `Encoder` answering batches from the API process.

Started by `ProcessEncoder` as `python -m qiao.engine.encoder_worker FD` with one end of a socket
pair. It reads its `EncoderSpec` from the first frame, loads the encoder, answers `ready` (or
`failed`), then answers each `run` frame (a batch of token-id rows) with one `result` frame (the
embeddings as raw bytes, dtype and shape) or one `error` frame. It stops when the API process
closes its end (after answering the batch it holds). A crash here (a segfault in a kernel, the OOM killer) ends
this process alone; the API process fails the batch it held and starts another.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
from typing import Any

import numpy as np

from qiao import envs
from qiao.engine import wire
from qiao.engine.async_engine import engine_failed_message
from qiao.engine.encoder_process import EncoderSpec
from qiao.engine.engine_worker import resident_bytes
from qiao.errors import QiaoError
from qiao.logs import configure_logging
from qiao.runner.encoder import Encoder

logger = logging.getLogger("qiao.engine.encoder")


def serve(sock: socket.socket, encoder: Encoder) -> None:
    """Answer `run` frames until the end of the stream."""
    while (frame := wire.recv_frame(sock)) is not None:
        if frame["t"] == "run":
            sock.sendall(wire.pack(run(encoder, frame["rows"])))


def run(encoder: Encoder, rows: list[list[int]]) -> dict[str, Any]:
    """One batch: its `result` frame, or an `error` frame naming the error class."""
    try:
        vectors = np.ascontiguousarray(encoder.embed(rows))
    except QiaoError as exc:
        return {"t": "error", "kind": type(exc).__name__, "error": str(exc)}
    except Exception as exc:  # a bug or a runtime failure: this batch fails, the process goes on
        logger.exception("a batch of %d rows failed", len(rows))
        return {"t": "error", "kind": "EngineUnavailableError", "error": engine_failed_message(exc)}
    return {
        "t": "result",
        "dtype": vectors.dtype.str,
        "shape": list(vectors.shape),
        "data": vectors.tobytes(),
        "resident_bytes": resident_bytes(),
    }


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    # The API process stops this one by closing its end of the socket; a signal
    # meant for the server's process group (Ctrl-C) must not kill it mid-batch first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = wire.recv_frame(sock)
    if settings is None:
        return 1
    configure_logging(settings["log_level"], f"encoder[{os.getpid()}]")
    try:
        encoder = EncoderSpec(**settings["spec"]).load()
        hook = envs.encoder_hook()
        if hook is not None:
            module_name, _, function = hook.partition(":")
            getattr(importlib.import_module(module_name), function)(encoder)
    except Exception as exc:
        logger.exception("the encoder failed to load")
        message = str(exc) if isinstance(exc, QiaoError) else f"{type(exc).__name__}: {exc}"
        sock.sendall(wire.pack({"t": "failed", "error": message}))
        return 1
    ready = {
        "t": "ready",
        "pid": os.getpid(),
        "dim": encoder.dim,
        "max_length": encoder.max_length,
        "resident_bytes": resident_bytes(),
    }
    sock.sendall(wire.pack(ready))
    # The API process may go away mid-batch: then nothing is left to answer.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        serve(sock, encoder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
