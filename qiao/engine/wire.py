"""Frames between the API process and an engine process: msgpack, never pickle.

A frame is a 4-byte big-endian length and one msgpack map with a type `t`. The API process sends
`add` (one request group, admitted together), `abort`, `stop_samples` (samples a stop string
ended: the API process detokenizes) and `stop`; the engine answers `ready`
once (or `failed`), then one `step` frame per turn of its loop: that turn's outputs, the requests
it refused, the commands it has applied so far and a stats snapshot. Outputs are token ids
(no text) and leave out what the API process already has (the prompt); everything else is plain
data.
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from typing import Any

import msgpack

from qiao.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qiao.sampling_params import SamplingParams

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


def pack(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


class FrameReader:
    """Splits a byte stream into frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes is over the limit")
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append(unpack(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return frames


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """One frame from a blocking socket; None at end of stream."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _recv_exactly(sock, length)
    if body is None:
        return None
    return unpack(body)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


# --- messages ------------------------------------------------------------------------------------


def params_to_wire(params: SamplingParams) -> list[Any]:
    return [getattr(params, name) for name in _PARAM_FIELDS]


def params_from_wire(values: list[Any]) -> SamplingParams:
    return SamplingParams(**dict(zip(_PARAM_FIELDS, values, strict=True)))


def output_to_wire(output: RequestOutput) -> list[Any]:
    metrics = output.metrics
    return [
        output.request_id,
        [_completion_to_wire(c) for c in output.outputs],
        output.finished,
        output.num_cached_tokens,
        None if metrics is None else [getattr(metrics, name) for name in _METRIC_FIELDS],
        None
        if output.prompt_logprobs is None
        else [_entry_to_wire(e) for e in output.prompt_logprobs],
    ]


def output_from_wire(
    values: list[Any], prompt: str | None, prompt_token_ids: list[int]
) -> RequestOutput:
    request_id, completions, finished, num_cached, metrics, prompt_logprobs = values
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=[_completion_from_wire(c) for c in completions],
        finished=finished,
        num_cached_tokens=num_cached,
        metrics=None
        if metrics is None
        else RequestMetrics(**dict(zip(_METRIC_FIELDS, metrics, strict=True))),
        prompt_logprobs=None
        if prompt_logprobs is None
        else [_entry_from_wire(e) for e in prompt_logprobs],
    )


def _entry_to_wire(entry: dict[int, Logprob] | None) -> dict[int, list[Any]] | None:
    if entry is None:
        return None
    return {tid: [lp.logprob, lp.rank, lp.decoded_token] for tid, lp in entry.items()}


def _entry_from_wire(entry: dict[int, list[Any]] | None) -> dict[int, Logprob] | None:
    if entry is None:
        return None
    return {tid: Logprob(*lp) for tid, lp in entry.items()}


def _completion_to_wire(c: CompletionOutput) -> list[Any]:
    logprobs = None
    if c.logprobs is not None:
        logprobs = [_entry_to_wire(entry) for entry in c.logprobs]
    return [
        c.index,
        c.text,
        c.token_ids,
        c.cumulative_logprob,
        logprobs,
        c.finish_reason,
        c.stop_reason,
    ]


def _completion_from_wire(values: list[Any]) -> CompletionOutput:
    index, text, token_ids, cumulative, logprobs, finish_reason, stop_reason = values
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=cumulative,
        logprobs=None if logprobs is None else [_entry_from_wire(entry) for entry in logprobs],  # type: ignore[misc]
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
