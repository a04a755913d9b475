"""From engine outputs to OpenAI responses: accumulate, stream as SSE, format logprobs.

Both endpoints run the same way: one engine request per prompt, merged into one response. A
non-streaming response is collected while a watcher listens for the client going away; a
streaming one is an SSE generator whose cancellation (client gone) closes the engine streams,
which aborts the requests and frees their KV blocks in the next engine step.

A request's deadline is kept here too, not only by the engine: the engine ends a request whose
deadline passed between steps, but while one step hangs only the API side can answer on time
(408, or `finish_reason: "timeout"` in a stream).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from qiao.api.errors import APIError, as_api_error, error_body
from qiao.logs import note_tokens
from qiao.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class Sample:
    """One choice being accumulated from delta outputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Job:
    """Everything one API request runs: a stream per prompt and how to label its choices."""

    streams: list[Any]  # RequestStream, one per prompt
    num_prompt_tokens: list[int]
    n: int
    num_top_logprobs: int | None  # None: no logprobs asked
    deadline: float | None = None  # time.monotonic() at which the request times out
    # Charges the tokens of the answer (prompt + completion) to the API key, when keys are used.
    charge: Callable[[int], None] | None = None
    # Prompt index -> its prompt logprobs (SamplingParams.prompt_logprobs), once they arrive.
    prompt_logprobs: dict[int, list[dict[int, Logprob] | None]] = field(default_factory=dict)

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.n + sample_index


class DeadlineExceeded(Exception):
    """The request's deadline passed before its last output arrived."""


async def close_all(job: Job, reason: str = "abort") -> None:
    for stream in job.streams:
        await stream.aclose(reason)


async def merged(job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from every prompt's stream as they come; raises
    DeadlineExceeded at the job's deadline, whatever the engine is doing."""
    if len(job.streams) == 1 and job.deadline is None:
        async for output in job.streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except BaseException as exc:  # forwarded to the consumer, which re-raises it
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(job.streams)]
    try:
        remaining = len(tasks)
        while remaining:
            if job.deadline is None:
                i, item = await queue.get()
            else:
                try:
                    i, item = await asyncio.wait_for(
                        queue.get(), max(job.deadline - time.monotonic(), 0.0)
                    )
                except TimeoutError:
                    raise DeadlineExceeded from None
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def fold(samples: dict[int, Sample], job: Job, prompt_index: int, output: RequestOutput) -> None:
    if output.prompt_logprobs is not None:
        job.prompt_logprobs[prompt_index] = output.prompt_logprobs
    for delta in output.outputs:
        index = job.choice_index(prompt_index, delta.index)
        sample = samples.setdefault(index, Sample(index))
        sample.text += delta.text
        sample.token_ids += delta.token_ids
        if delta.logprobs:
            sample.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason


async def collect(job: Job, request: Request) -> list[Sample]:
    """Run a non-streaming job to the end; a client that disconnects aborts it."""

    async def consume() -> list[Sample]:
        samples: dict[int, Sample] = {}
        reason = "abort"
        try:
            async for prompt_index, output in merged(job):
                fold(samples, job, prompt_index, output)
        except DeadlineExceeded:
            reason = "timeout"
            raise
        finally:
            await close_all(job, reason)
        return [samples[i] for i in sorted(samples)]

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()  # the client left: consume()'s finally aborts the requests
    # cancel() only requests cancellation, so a just-cancelled task is not done yet.
    if not work.done() or work.cancelled():
        raise APIError(499, "client closed the request")
    try:
        samples = work.result()
    except DeadlineExceeded:
        raise _timeout_error() from None
    except Exception as exc:  # engine-side failures become their HTTP errors
        raise as_api_error(exc) from None
    used = sum(job.num_prompt_tokens) + sum(len(s.token_ids) for s in samples)
    note_tokens(used)
    if job.charge is not None:
        job.charge(used)
    _raise_for_unfinished(samples)
    return samples


def _timeout_error() -> APIError:
    return APIError(408, "the request passed its timeout before it finished", code="timeout")


def _raise_for_unfinished(samples: list[Sample]) -> None:
    reasons = {s.finish_reason for s in samples}
    if "timeout" in reasons:
        raise _timeout_error()
    if "abort" in reasons:
        raise APIError(
            503,
            "the request was aborted: the server is shutting down",
            code="aborted",
            headers={"Retry-After": "1"},
        )


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def usage(job: Job, samples: list[Sample]) -> dict[str, int]:
    prompt = sum(job.num_prompt_tokens)
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(
    job: Job,
    make_chunks: Callable[[int, CompletionOutput, list[dict[int, Logprob]] | None], list[dict]],
    usage_chunk: Callable[[dict[str, int]], dict] | None,
    first_chunks: list[dict] | None = None,
) -> AsyncIterator[str]:
    """SSE body: chunks as deltas arrive, then usage (if asked), then [DONE].

    An engine error mid-stream becomes an error event (the status line is already sent). At the
    deadline every choice still open ends with `finish_reason: "timeout"`.
    """
    completion_tokens = 0
    finished: set[int] = set()
    reason = "abort"
    try:
        for chunk in first_chunks or []:
            yield sse(chunk)
        try:
            async for prompt_index, output in merged(job):
                for delta in output.outputs:
                    completion_tokens += len(delta.token_ids)
                    index = job.choice_index(prompt_index, delta.index)
                    if delta.finish_reason is not None:
                        finished.add(index)
                    for chunk in make_chunks(index, delta, delta.logprobs):
                        yield sse(chunk)
        except DeadlineExceeded:
            reason = "timeout"
            await close_all(job, reason)
            for event in _end_open_choices(job, finished, "timeout", make_chunks):
                yield event
        if usage_chunk is not None:
            prompt = sum(job.num_prompt_tokens)
            yield sse(
                usage_chunk(
                    {
                        "prompt_tokens": prompt,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt + completion_tokens,
                    }
                )
            )
        yield sse("[DONE]")
    except Exception as exc:
        # Every choice still open ends with finish_reason "error", then the error event.
        for event in _end_open_choices(job, finished, "error", make_chunks):
            yield event
        error = as_api_error(exc)
        yield sse(error_body(error.status_code, error.message, error.param, error.code))
    finally:
        await close_all(job, reason)
        note_tokens(sum(job.num_prompt_tokens) + completion_tokens)
        if job.charge is not None:
            job.charge(sum(job.num_prompt_tokens) + completion_tokens)


def _end_open_choices(
    job: Job,
    finished: set[int],
    reason: str,
    make_chunks: Callable[[int, CompletionOutput, list[dict[int, Logprob]] | None], list[dict]],
) -> list[str]:
    """SSE events closing every choice not finished yet with `finish_reason: reason`."""
    events = []
    for index in range(len(job.streams) * job.n):
        if index not in finished:
            end = CompletionOutput(index, "", [], finish_reason=reason)
            events += [sse(chunk) for chunk in make_chunks(index, end, None)]
    return events


def now() -> int:
    return int(time.time())


# --- logprobs -------------------------------------------------------------------------------


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def _token_text(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"<{token_id}>"


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text_start: int = 0
) -> dict[str, Any]:
    """The legacy completions format: parallel lists of tokens, logprobs, top-k dicts, offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_start
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry[token_id]
        text = _token_text(chosen, token_id)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({_token_text(lp, tid): lp.logprob for tid, lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_ids: list[int],
    prompt_entries: list[dict[int, Logprob] | None],
    first_text: str,
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    k: int,
) -> dict[str, Any]:
    """`completion_logprobs` of an echoed prompt and its completion: the prompt's first token
    (nothing predicts it) has null logprobs, as OpenAI's legacy API gives."""
    tokens, token_logprobs, top, offsets = [first_text], [None], [None], [0]
    offset = len(first_text)
    for token_id, entry in zip(prompt_ids[1:], prompt_entries[1:], strict=True):
        assert entry is not None
        chosen = entry[token_id]
        text = _token_text(chosen, token_id)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({_token_text(lp, tid): lp.logprob for tid, lp in _top(entry, k)})
        offsets.append(offset)
        offset += len(text)
    rest = completion_logprobs(token_ids, entries, k, text_start=offset)
    return {
        "tokens": tokens + rest["tokens"],
        "token_logprobs": token_logprobs + rest["token_logprobs"],
        "top_logprobs": top + rest["top_logprobs"],
        "text_offset": offsets + rest["text_offset"],
    }


def prompt_logprobs_json(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, null or {token id: logprob, rank, text}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in entries
    ]


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int
) -> dict[str, Any]:
    """The chat format: one object per token with its top-k alternatives."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry[token_id]
        text = _token_text(chosen, token_id)
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(lp, tid)),
                        "logprob": lp.logprob,
                        "bytes": list(t.encode()),
                    }
                    for tid, lp in _top(entry, k)
                ],
            }
        )
    return {"content": content}
