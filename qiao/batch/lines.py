"""OpenAI batch files: the input's lines, and the output and error files' lines.

An input line is `{"custom_id": ..., "method": "POST", "url": ENDPOINT, "body": {...}}`. A line
that cannot be read (not JSON, a missing field, an unsupported url, a reused custom_id) does not
end the batch: it becomes an error line, as a request the server refused would.

An output line is OpenAI's BatchRequestOutput: `{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}`. Answered requests (status 200) go to the output file; refused or
failed ones to the error file, with `response.body` holding the `{"error": ...}` the HTTP route
would have sent, or, for a line that never became a request, `response: null` and `error: {code,
message}`. Ids are derived from the job's id and the line's number, so a resumed run writes the
same ids as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_CUSTOM_ID_LENGTH = 512


@dataclass(frozen=True)
class LineError:
    """Why a line could not run: an HTTP status and OpenAI's error fields."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class BatchLine:
    """One non-blank input line. `number` is 1-based, as editors and OpenAI's errors count."""

    number: int
    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    error: LineError | None = None  # set when the line cannot run; the rest may be None


def read_lines(path: Path, endpoint: str | None = None) -> Iterator[BatchLine]:
    """The file's non-blank lines, checked. With `endpoint`, every line must name that url (as
    OpenAI's batches have one endpoint each); without it, any of ENDPOINTS."""
    seen: dict[str, int] = {}
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            line = parse_line(number, raw, endpoint)
            if line.custom_id is not None and line.error is None:
                first = seen.setdefault(line.custom_id, number)
                if first != number:
                    line = BatchLine(
                        number,
                        line.custom_id,
                        line.url,
                        line.body,
                        LineError(
                            400,
                            f"custom_id {line.custom_id!r} is already used on line {first}; "
                            "each line needs its own",
                            "custom_id",
                            "duplicate_custom_id",
                        ),
                    )
            yield line


def parse_line(number: int, raw: bytes, endpoint: str | None = None) -> BatchLine:
    """One input line, or the error that keeps it from running."""
    try:
        entry = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return _refused(number, None, f"line {number} is not valid JSON ({exc})", "invalid_json")
    if not isinstance(entry, dict):
        return _refused(number, None, f"line {number} must be a JSON object", "invalid_request")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _refused(
            number, None, f"line {number}: custom_id must be a non-empty string", "invalid_request"
        )
    if len(custom_id) > MAX_CUSTOM_ID_LENGTH:
        return _refused(
            number,
            None,
            f"line {number}: custom_id is {len(custom_id)} characters; at most "
            f"{MAX_CUSTOM_ID_LENGTH}",
            "invalid_request",
        )
    method, url, body = entry.get("method"), entry.get("url"), entry.get("body")
    problem = None
    if method != "POST":
        problem = LineError(400, f"method must be 'POST', got {method!r}", "method")
    elif url not in ENDPOINTS:
        problem = LineError(
            400, f"url must be one of {', '.join(ENDPOINTS)}; got {url!r}", "url", "invalid_url"
        )
    elif endpoint is not None and url != endpoint:
        problem = LineError(
            400, f"url is {url!r} but this batch's endpoint is {endpoint!r}", "url", "invalid_url"
        )
    elif not isinstance(body, dict):
        problem = LineError(400, "body must be a JSON object (the request's body)", "body")
    elif body.get("stream"):
        problem = LineError(400, "body.stream: a batch request cannot stream", "stream")
    return BatchLine(number, custom_id, url, body if isinstance(body, dict) else None, problem)


def _refused(number: int, custom_id: str | None, message: str, code: str) -> BatchLine:
    return BatchLine(number, custom_id, None, None, LineError(400, message, None, code))


def error_body(error: LineError) -> dict[str, Any]:
    """The body the HTTP route answers an error with (OpenAI's envelope)."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return {
        "error": {
            "message": error.message,
            "type": kind,
            "param": error.param,
            "code": error.code,
        }
    }


def line_ids(job_id: str, number: int) -> tuple[str, str]:
    """(the output line's id, its response's request_id): stable for a job's line."""
    digest = hashlib.sha256(f"{job_id}:{number}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}", f"req_{digest[32:64]}"


def response_line(
    job_id: str, line: BatchLine, status: int, body: dict[str, Any]
) -> dict[str, Any]:
    """The output (status 200) or error file line of a request that ran or was refused."""
    line_id, request_id = line_ids(job_id, line.number)
    return {
        "id": line_id,
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(job_id: str, line: BatchLine, error: LineError) -> dict[str, Any]:
    """The error file line of a line that cannot run. A line without a readable custom_id has
    no response (OpenAI's `error: {code, message}`); one with it gets the route's answer."""
    if line.custom_id is None:
        line_id, _ = line_ids(job_id, line.number)
        return {
            "id": line_id,
            "custom_id": None,
            "response": None,
            "error": {"code": error.code or "invalid_request", "message": error.message},
        }
    return response_line(job_id, line, error.status, error_body(error))
