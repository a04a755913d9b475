"""OpenAI's Batch API: `POST /v1/batches`, `GET /v1/batches[/{id}]`,
`POST /v1/batches/{id}/cancel`, and the worker that runs batches on the served models.

A batch reads an uploaded file (`purpose: batch`) of lines for one endpoint and goes through
OpenAI's states: validating (the file is read) → in_progress (lines run, `request_counts`
grow) → finalizing (the output and error files are written, `purpose: batch_output`) →
completed; failed when the input cannot run at all; expired when its completion window passes
(lines done so far are still written); cancelling → cancelled on request (likewise).

Every finished line is recorded in the store before it counts, so a batch survives a restart:
the server resumes unfinished batches when it starts and runs only their unrecorded lines.
Lines run at `--batch-priority` plus the batch's `metadata.priority` (0 to 1000, default 0:
less urgent than online requests, and larger numbers after smaller ones), at most
`--batch-max-in-flight` of a batch at once and `--batch-concurrency` batches at once, waiting
batches by the same priority; each is answered as its route would answer it
(`batch_requests`). A line interrupted by the server stopping, or refused for a passing reason
(503: an engine restarting, a full queue), is not recorded: it runs again (after a pause, or on
the next start).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
from types import SimpleNamespace
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from qiao.api.batch_requests import (
    embedding_answer,
    line_error,
    llm_answer,
    prepare_embedding,
    prepare_llm,
)
from qiao.api.errors import APIError, as_api_error
from qiao.api.files import list_page, owner_of, store_for, store_of
from qiao.api.keys import key_of
from qiao.api.lora_adapters import split_adapter
from qiao.api.openai_routes import split_model_id
from qiao.api.serving import Sample, close_all, fold, merged
from qiao.api.webhooks import Notifier, check_target, new_event
from qiao.batch.lines import ENDPOINTS, BatchLine, error_line, read_lines
from qiao.batch.results import write_lines_atomically
from qiao.batch.store import FINISHED, BatchStore
from qiao.engine.async_engine import GenerateRequest
from qiao.repository.served import EncoderVersion, LLMVersion

logger = logging.getLogger("qiao.batches")
router = APIRouter()

MAX_METADATA_PAIRS = 16
# metadata.priority: a batch's own priority, 0 (the default, first) to this (last).
MAX_JOB_PRIORITY = 1000
FLUSH_INTERVAL_S = 0.5  # most time between recording finished lines
RETRY_PAUSE_S = 1.0  # before running again the lines refused for a passing reason
MAX_WINDOW_S = 7 * 24 * 3600


class _Transient(Exception):
    """A line that did not finish for a passing reason; it is not recorded and runs again."""


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None)


def _window_seconds(window: str) -> int:
    match = re.fullmatch(r"(\d+)([hm])", window)
    seconds = int(match.group(1)) * (3600 if match.group(2) == "h" else 60) if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise APIError(
            400,
            f"completion_window: {window!r} must be a duration like '24h' or '90m', at most 168h",
            param="completion_window",
        )
    return seconds


@router.post("/v1/batches")
async def create_batch(body: CreateBatch, request: Request) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint: must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = _window_seconds(body.completion_window)
    metadata = body.metadata
    if metadata is not None and (
        len(metadata) > MAX_METADATA_PAIRS
        or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())
    ):
        raise APIError(
            400,
            "metadata: at most 16 pairs, keys up to 64 and values up to 512 characters",
            param="metadata",
        )
    job_priority(metadata)  # a bad one is refused now, not when the batch runs
    target = (metadata or {}).get("webhook_url")
    if target is not None:
        try:
            check_target(target, request.app.state.settings.webhook_allowed_hosts)
        except Exception as exc:
            raise as_api_error(exc) from None
    source = store_of(request).get_file(owner_of(request), body.input_file_id)
    if source is None:
        raise APIError(
            404,
            f"input_file_id: no file {body.input_file_id!r}",
            param="input_file_id",
            code="file_not_found",
        )
    if source.purpose != "batch":
        raise APIError(
            400,
            f"input_file_id: file {source.id!r} has purpose {source.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    key = key_of(request)
    now = int(time.time())
    doc = {
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + window,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
        "webhook_deliveries": [],  # qiao: every delivery attempt of the end event
        # The models the creating key may use, checked again for every line.
        "_models": key.models if key is not None else None,
    }
    created = store_of(request).add_batch(owner_of(request), doc)
    logger.info("batch %s: validating (%s, file %s)", created["id"], body.endpoint, source.id)
    worker(request).submit(created["id"], job_priority(metadata))
    return _public(created)


@router.get("/v1/batches")
async def list_batches(
    request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None
) -> dict[str, Any]:
    try:
        docs, has_more = store_of(request).list_batches(owner_of(request), limit=limit, after=after)
    except Exception as exc:
        raise as_api_error(exc) from None
    return list_page([_public(doc) for doc in docs], has_more)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
    return _public(_owned_batch(request, batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    _owned_batch(request, batch_id)
    store = store_of(request)

    def cancelling(doc: dict[str, Any]) -> None:
        if doc["status"] in ("validating", "in_progress"):  # checked under the store's lock
            doc["status"] = "cancelling"
            doc["cancelling_at"] = int(time.time())

    store.change_batch(batch_id, cancelling)
    doc = _owned_batch(request, batch_id)
    if doc["status"] not in ("cancelling", "cancelled"):
        raise APIError(
            409,
            f"batch {batch_id!r} is {doc['status']}; only a validating or in_progress batch "
            "can be cancelled",
            code="batch_not_cancellable",
        )
    if doc["status"] == "cancelling":
        logger.info("batch %s: cancelling", batch_id)
        worker(request).cancel(batch_id)
    return _public(doc)


def job_priority(metadata: dict[str, str] | None) -> int:
    """A batch's `metadata.priority`: 0 (the default) runs first, larger ones later. It orders
    the batches waiting for a worker, and its lines' engine priority is `--batch-priority` plus
    it, so among batches running at once the engine also serves the smaller first."""
    text = (metadata or {}).get("priority")
    if text is None:
        return 0
    if not re.fullmatch(r"\d{1,4}", text.strip()) or int(text) > MAX_JOB_PRIORITY:
        raise APIError(
            400,
            f"metadata.priority: {text!r} must be an integer from 0 (first, the default) to "
            f"{MAX_JOB_PRIORITY} (last)",
            param="metadata",
        )
    return int(text)


def _owned_batch(request: Request, batch_id: str) -> dict[str, Any]:
    doc = store_of(request).get_batch(batch_id, owner_of(request))
    if doc is None:
        raise APIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
    return doc


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def worker(request: Request) -> BatchWorker:
    return request.app.state.batch_worker


# --- the worker ----------------------------------------------------------------------------------


class BatchWorker:
    """Runs batches in the server's event loop: `--batch-concurrency` at once, by
    `metadata.priority`, then in creation order. `start` resumes the unfinished batches of an existing store."""

    def __init__(self, app_state: Any) -> None:
        self.state = app_state
        self.settings = app_state.settings
        # (metadata.priority, submission order, id): the smallest runs next.
        self._queue: asyncio.PriorityQueue[tuple[int, int, str]] = asyncio.PriorityQueue()
        self._submitted = itertools.count()
        self._cancelled: dict[str, asyncio.Event] = {}
        self._running: dict[str, asyncio.Task[None]] = {}
        self._loops: list[asyncio.Task[None]] = []
        self.notifier = Notifier(
            self.settings.webhook_secret,
            max_attempts=self.settings.webhook_max_attempts,
            retry_base_s=self.settings.webhook_retry_base,
        )
        self._deliveries: set[asyncio.Task[None]] = set()
        self.metrics = app_state.metrics
        # Batches by status for /metrics, once the store is open (a scrape never opens it).
        self.metrics.batch_jobs = lambda: (
            app_state.store.batch_counts() if getattr(app_state, "store", None) else {}
        )

    @property
    def store(self) -> BatchStore:
        return store_for(self.state)

    async def start(self) -> None:
        self._loops = [
            asyncio.ensure_future(self._loop()) for _ in range(self.settings.batch_concurrency)
        ]
        if (self.settings.data_dir / "qiao.sqlite").exists():
            for batch_id in self.store.unfinished_batch_ids():
                logger.info("batch %s: resuming", batch_id)
                doc = self.store.get_batch(batch_id) or {}
                self.submit(batch_id, job_priority(doc.get("metadata")))
            for doc in self.store.batches_with_pending_webhooks():
                self._deliver_pending(doc)

    async def stop(self) -> None:
        """Stop at once: lines in flight are not recorded and run again on the next start."""
        tasks = [*self._loops, *self._running.values(), *self._deliveries]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def submit(self, batch_id: str, priority: int = 0) -> None:
        self._queue.put_nowait((priority, next(self._submitted), batch_id))

    def cancel(self, batch_id: str) -> None:
        self._cancel_event(batch_id).set()

    def _cancel_event(self, batch_id: str) -> asyncio.Event:
        return self._cancelled.setdefault(batch_id, asyncio.Event())

    async def _loop(self) -> None:
        while True:
            _, _, batch_id = await self._queue.get()
            task = asyncio.ensure_future(self._run(batch_id))
            self._running[batch_id] = task
            try:
                await task
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("batch %s: the worker failed", batch_id)
                self._fail(batch_id, "internal_error", "the batch worker failed; see the log")
            finally:
                self._running.pop(batch_id, None)

    # --- one batch ---------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        store = self.store
        doc = store.get_batch(batch_id)
        if doc is None or doc["status"] in FINISHED:
            return
        lines = await self._read(doc)
        if lines is None:
            return
        if doc["status"] == "validating":

            def begin(doc: dict[str, Any]) -> None:
                if doc["status"] == "validating":  # not cancelled meanwhile
                    doc["status"] = "in_progress"
                    doc["in_progress_at"] = int(time.time())
                doc["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}

            store.change_batch(batch_id, begin)
            doc = store.get_batch(batch_id) or doc
            logger.info("batch %s: %s (%d lines)", batch_id, doc["status"], len(lines))
        if doc["status"] == "in_progress":
            end = await self._run_lines(doc, lines)
        else:
            end = "cancelled" if doc["status"] == "cancelling" else "completed"
        await self._finalize(batch_id, end)

    async def _read(self, doc: dict[str, Any]) -> list[BatchLine] | None:
        store = self.store
        source = store.get_file(store.batch_owner(doc["id"]), doc["input_file_id"])
        if source is None:
            self._fail(doc["id"], "file_not_found", f"input file {doc['input_file_id']} is gone")
            return None
        path = store.file_path(source)
        lines = await run_in_threadpool(lambda: list(read_lines(path, doc["endpoint"])))
        if not lines:
            self._fail(doc["id"], "empty_file", "the input file has no lines")
            return None
        return lines

    async def _run_lines(self, doc: dict[str, Any], lines: list[BatchLine]) -> str:
        """Run the unrecorded lines; the state the batch ends in."""
        batch_id = doc["id"]
        store = self.store
        results: list[tuple[int, bool, str]] = []
        retry: list[BatchLine] = []
        pending = [line for line in lines if line.number not in store.done_numbers(batch_id)]
        limit = asyncio.Semaphore(self.settings.batch_max_in_flight)
        end = "completed"

        async def one(line: BatchLine) -> None:
            try:
                ok, record = await self._run_line(doc, line)
            except _Transient:
                retry.append(line)
                return
            finally:
                limit.release()
            results.append((line.number, ok, record))

        async def flush() -> None:
            while True:
                await asyncio.sleep(FLUSH_INTERVAL_S)
                self._record(batch_id, results)

        flusher = asyncio.ensure_future(flush())
        cancelled = self._cancel_event(batch_id)
        tasks: list[asyncio.Task[None]] = []
        try:
            while pending and end == "completed":
                for line in pending:
                    await limit.acquire()
                    if cancelled.is_set():
                        end = "cancelled"
                    elif time.time() > doc["expires_at"]:
                        end = "expired"
                    if end != "completed":
                        limit.release()
                        break
                    tasks.append(asyncio.ensure_future(one(line)))
                if end == "completed" and tasks:
                    waiting = asyncio.ensure_future(cancelled.wait())
                    await asyncio.wait(
                        [asyncio.gather(*tasks, return_exceptions=True), waiting],
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    waiting.cancel()
                    if cancelled.is_set():
                        end = "cancelled"
                if end != "completed":
                    for task in tasks:
                        task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                tasks.clear()
                pending, retry = retry, []
                if pending and end == "completed":
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            flusher.cancel()
            for task in tasks:
                task.cancel()
            self._record(batch_id, results)
        return end

    def _record(self, batch_id: str, results: list[tuple[int, bool, str]]) -> None:
        if results:
            rows = list(results)
            results.clear()
            self.store.add_results(batch_id, rows)
            answered = sum(1 for _, ok, _ in rows if ok)
            self.metrics.batch_lines.labels("answered").inc(answered)
            self.metrics.batch_lines.labels("failed").inc(len(rows) - answered)

    async def _run_line(self, doc: dict[str, Any], line: BatchLine) -> tuple[bool, str]:
        batch_id = doc["id"]
        if line.error is not None:
            return False, json.dumps(error_line(batch_id, line, line.error))
        try:
            record = await self._answer(doc, line)
        except (_Transient, asyncio.CancelledError):
            raise
        except Exception as exc:
            error = line_error(exc)
            if error.status == 503:
                raise _Transient from None
            return False, json.dumps(error_line(batch_id, line, error))
        tokens = record["response"]["body"].get("usage", {}).get("completion_tokens", 0)
        self.metrics.batch_generation_tokens.inc(tokens)
        return True, json.dumps(record, ensure_ascii=False)

    async def _answer(self, doc: dict[str, Any], line: BatchLine) -> dict[str, Any]:
        assert line.body is not None
        model = line.body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "model: required (a served model's name)", param="model")
        base, lora_name = split_adapter(self.state.router, model)
        name, version = split_model_id(base)
        allowed = doc.get("_models")
        if allowed is not None and name not in allowed:
            raise APIError(
                404,
                f"model {model!r} is not served for this batch's key",
                param="model",
                code="model_not_found",
            )
        served = self.state.router.get(name, version, user=line.body.get("user"))
        priority = self.settings.batch_priority + job_priority(doc.get("metadata"))
        if line.url == "/v1/embeddings":
            if not isinstance(served, EncoderVersion):
                raise APIError(400, f"model {model!r} is a generative model", param="model")
            encoder = SimpleNamespace(dim=served.encoder.dim, tokenize=served.tokenize)
            body, token_ids = prepare_embedding(line, self.settings, encoder)
            # The batcher's levels count from 1 (most urgent): batch lines take the last.
            lowest = served.batcher.config.priority_levels
            vectors = await served.embed_ids(token_ids, priority=lowest)
            return embedding_answer(doc["id"], line, body, token_ids, vectors)
        if not isinstance(served, LLMVersion):
            raise APIError(
                400, f"model {model!r} is an embedding model; use /v1/embeddings", param="model"
            )
        engine = served.engine
        prepared = prepare_llm(line, self.settings, engine, engine.vocab_size)
        requests = [
            GenerateRequest(
                f"{doc['id']}-{line.number}-{i}",
                prompt,
                params,
                priority=priority,
                lora_name=lora_name,
            )
            for i, (prompt, params) in enumerate(
                zip(prepared.prompts, prepared.params, strict=True)
            )
        ]
        job = prepared.new_job()
        job.streams = engine.generate_all(requests)
        samples: dict[int, Sample] = {}
        try:
            async for prompt_index, output in merged(job):
                fold(samples, job, prompt_index, output)
        finally:
            await close_all(job)
        finished = [samples[i] for i in sorted(samples)]
        if any(s.finish_reason in ("abort", "timeout", None) for s in finished):
            raise _Transient  # the engine stopped it (shutting down): run it again
        return llm_answer(doc["id"], prepared, finished, job, engine.tokenizer)

    async def _finalize(self, batch_id: str, end: str) -> None:
        store = self.store
        now = int(time.time())
        if end == "completed":
            store.update_batch(batch_id, status="finalizing", finalizing_at=now)
            logger.info("batch %s: finalizing", batch_id)
        owner = store.batch_owner(batch_id)

        def write(ok: bool, kind: str) -> str | None:
            records = store.batch_records(batch_id, ok)
            if not records:
                return None
            stored = store.add_file_from_lines(
                owner, "batch_output", f"{batch_id}_{kind}.jsonl", iter(records)
            )
            return stored.id

        output_id = await run_in_threadpool(write, True, "output")
        error_id = await run_in_threadpool(write, False, "error")
        copies = await run_in_threadpool(self._copy_results, batch_id)
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
        doc = store.update_batch(
            batch_id,
            status=end,
            output_file_id=output_id,
            error_file_id=error_id,
            **copies,
            **{stamp[end]: int(time.time())},
        )
        self._cancelled.pop(batch_id, None)
        self._notify(batch_id, end)
        counts = doc["request_counts"]
        logger.info(
            "batch %s: %s (%d answered, %d failed of %d)",
            batch_id,
            end,
            counts["completed"],
            counts["failed"],
            counts["total"],
        )

    def _copy_results(self, batch_id: str) -> dict[str, Any]:
        """Write the batch's output and error lines under --batch-output-url as well, each
        atomically (results.py); returns the fields recording where (`output_url`,
        `error_url`), or why not (`result_store_error`: the files in the data directory stand,
        and the batch still ends)."""
        prefix = self.settings.batch_output_url
        if not prefix:
            return {}
        fields: dict[str, Any] = {}
        try:
            for ok, name, field in ((True, "output", "output_url"), (False, "errors", "error_url")):
                records = self.store.batch_records(batch_id, ok)
                if records:
                    url = f"{prefix.rstrip('/')}/{batch_id}/{name}.jsonl"
                    write_lines_atomically(url, records)
                    fields[field] = url
        except Exception as exc:  # the store is unreachable, full, or refuses the write
            logger.warning("batch %s: results not written to %s: %s", batch_id, prefix, exc)
            fields["result_store_error"] = f"{type(exc).__name__}: {exc}"
        return fields

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        self.store.update_batch(
            batch_id,
            status="failed",
            failed_at=int(time.time()),
            errors={"object": "list", "data": [{"code": code, "message": message, "line": None}]},
        )
        logger.info("batch %s: failed (%s)", batch_id, message)
        self._notify(batch_id, "failed")

    # --- notification ------------------------------------------------------------------------

    def _notify(self, batch_id: str, status: str) -> None:
        """Start delivering the batch's end event to the server's and the batch's URLs."""
        doc = self.store.get_batch(batch_id)
        assert doc is not None
        targets = [self.settings.webhook_url, (doc.get("metadata") or {}).get("webhook_url")]
        urls = list(dict.fromkeys(url for url in targets if url))
        if not urls:
            return
        event = new_event(batch_id, status)

        def pending(doc: dict[str, Any]) -> None:
            doc["_webhook_event"] = event
            doc["_webhook_pending"] = urls

        self.store.change_batch(batch_id, pending)
        self._deliver_pending({**doc, "_webhook_event": event, "_webhook_pending": urls})

    def _deliver_pending(self, doc: dict[str, Any]) -> None:
        batch_id, event = doc["id"], doc["_webhook_event"]
        for url in doc["_webhook_pending"]:
            target = self._target(url)
            tried = sum(1 for d in doc.get("webhook_deliveries", []) if d["target"] == target)
            task = asyncio.ensure_future(self._deliver(batch_id, url, event, tried + 1))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)

    def _target(self, url: str) -> str:
        """ "server" for --webhook-url, "metadata" for the batch's own webhook_url."""
        return "server" if url == self.settings.webhook_url else "metadata"

    async def _deliver(self, batch_id: str, url: str, event: dict[str, Any], first: int) -> None:
        store = self.store

        target = self._target(url)

        def record(attempt: dict[str, Any]) -> None:
            # The server-wide URL is the operator's: users see that it was tried, not where.
            attempt = {"target": target, **attempt}
            if target == "server":
                attempt["url"] = None
            store.change_batch(
                batch_id, lambda doc: doc.setdefault("webhook_deliveries", []).append(attempt)
            )

        delivered = await self.notifier.deliver(url, event, first, record)

        def done(doc: dict[str, Any]) -> None:
            doc["_webhook_pending"] = [u for u in doc.get("_webhook_pending", []) if u != url]

        store.change_batch(batch_id, done)
        logger.info(
            "batch %s: %s %s to %s",
            batch_id,
            event["type"],
            "delivered" if delivered else "not delivered (attempts exhausted)",
            url,
        )
