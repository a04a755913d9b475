"""Runs a batch job's lines on an in-process engine (and encoder), at offline speed.

Each line becomes what the HTTP route would make of its body: the same request models, field
checks, prompt rendering, token budgets and response assembly (`qiao.api.openai_routes`,
`qiao.api.embeddings`), so a batch answer is the answer the server gives. The engine is stepped
here, as `LLM.generate` steps it, with enough lines admitted to keep its batches full; a line
is reported the moment its last prompt finishes. Embedding lines are encoded in chunks between
engine steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from qiao.api.batch_requests import (
    LLMLine,
    embedding_answer,
    line_error,
    llm_answer,
    prepare_embedding,
    prepare_llm,
)
from qiao.api.embeddings import EmbeddingRequest
from qiao.api.errors import APIError
from qiao.api.serving import Job, Sample, fold
from qiao.api.settings import ServeSettings
from qiao.batch.lines import BatchLine, LineError, error_line
from qiao.engine.llm_engine import LLMEngine
from qiao.outputs import RequestOutput
from qiao.runner.encoder import Encoder

# (line, answered?, output or error file line) for each finished line.
ResultSink = Callable[[BatchLine, bool, dict[str, Any]], None]


@dataclass
class _LLMLine:
    """A chat or completions line in the engine: its prompts' requests and their samples."""

    prepared: LLMLine
    job: Job
    request_ids: list[str]
    unfinished: set[str]
    samples: dict[int, Sample] = field(default_factory=dict)

    @property
    def line(self) -> BatchLine:
        return self.prepared.line

    @property
    def n(self) -> int:
        return self.prepared.body.n


@dataclass
class _EmbeddingLine:
    line: BatchLine
    body: EmbeddingRequest
    token_ids: list[list[int]]


class OfflineBatch:
    """Runs lines through `engine` (chat and completions) and `encoder` (embeddings); either may
    be None, and a line for a missing one is an error line naming `missing_hint`."""

    def __init__(
        self,
        job_id: str,
        engine: LLMEngine | None,
        encoder: Encoder | None,
        *,
        settings: ServeSettings | None = None,
        model_name: str = "",
        embedding_model_name: str = "",
        encoder_batch_size: int = 64,
        missing_hint: str = "",
    ) -> None:
        self.job_id = job_id
        self.engine = engine
        self.encoder = encoder
        self.settings = settings or ServeSettings()
        self.model_name = model_name
        self.embedding_model_name = embedding_model_name
        self.encoder_batch_size = encoder_batch_size
        self.missing_hint = missing_hint
        # Enough sequences admitted that every step is full: the running batch plus as many
        # waiting to take the place of those that finish.
        seqs = engine.config.scheduler.max_num_seqs if engine is not None else 0
        self.max_in_flight = max(2 * seqs, 16)
        self.generated_tokens = 0
        self._llm: dict[str, _LLMLine] = {}  # engine request id -> its line
        self._in_flight = 0  # engine sequences admitted, not finished
        self._embeddings: deque[_EmbeddingLine] = deque()
        self._queued_inputs = 0  # embedding inputs in `_embeddings`
        self._sink: ResultSink = lambda line, ok, record: None

    def run(self, lines: Iterable[BatchLine], sink: ResultSink) -> None:
        """Run every line; `sink` gets each finished line as it finishes (any order)."""
        self._sink = sink
        pending = iter(lines)
        exhausted = False
        while True:
            while not exhausted and self._room():
                line = next(pending, None)
                if line is None:
                    exhausted = True
                else:
                    self._admit(line)
            if self._embeddings and (exhausted or not self._room() or not self._llm):
                self._embed_chunk()
            if self._llm:
                self._step()
            elif exhausted and not self._embeddings:
                return

    def _room(self) -> bool:
        return (
            self._in_flight < self.max_in_flight
            and self._queued_inputs < 4 * self.encoder_batch_size
        )

    # --- admission ---------------------------------------------------------------------------

    def _admit(self, line: BatchLine) -> None:
        if line.error is not None:
            self._finish_error(line, line.error)
            return
        try:
            if line.url == "/v1/embeddings":
                self._admit_embedding(line)
            else:
                self._admit_llm(line)
        except Exception as exc:
            self._finish_error(line, line_error(exc))

    def _admit_llm(self, line: BatchLine) -> None:
        engine = self.engine
        if engine is None:
            raise APIError(
                404,
                f"this batch has no generative model for {line.url}{self.missing_hint}",
                param="model",
                code="model_not_found",
            )
        prepared = prepare_llm(line, self.settings, engine, engine.arch.vocab_size)
        request_ids = [f"batch-{line.number}-{i}" for i in range(len(prepared.prompts))]
        priority = prepared.body.priority or 0
        added: list[str] = []
        try:
            for request_id, prompt, params in zip(
                request_ids, prepared.prompts, prepared.params, strict=True
            ):
                engine.add_request(request_id, prompt, params, priority=priority)
                added.append(request_id)
        except Exception:
            engine.abort_request(added)  # every prompt of the line runs, or none
            raise
        entry = _LLMLine(prepared, prepared.new_job(), request_ids, set(request_ids))
        for request_id in request_ids:
            self._llm[request_id] = entry
        self._in_flight += len(request_ids) * prepared.body.n

    def _admit_embedding(self, line: BatchLine) -> None:
        encoder = self.encoder
        if encoder is None:
            raise APIError(
                404,
                f"this batch has no embedding model for {line.url}{self.missing_hint}",
                param="model",
                code="model_not_found",
            )
        body, token_ids = prepare_embedding(line, self.settings, encoder)
        self._embeddings.append(_EmbeddingLine(line, body, token_ids))
        self._queued_inputs += len(token_ids)

    # --- generation --------------------------------------------------------------------------

    def _step(self) -> None:
        engine = self.engine
        assert engine is not None
        outputs = engine.step()
        failures = dict(engine.take_failed_requests())
        for output in outputs:
            entry = self._llm.get(output.request_id)
            if entry is not None:
                self._fold(entry, output, failures.get(output.request_id))

    def _fold(self, entry: _LLMLine, output: RequestOutput, failure: Exception | None) -> None:
        prompt_index = entry.request_ids.index(output.request_id)
        fold(entry.samples, entry.job, prompt_index, output)
        if not output.finished and failure is None:
            return
        entry.unfinished.discard(output.request_id)
        del self._llm[output.request_id]
        self._in_flight -= entry.n
        if failure is not None:
            self._drop(entry)
            self._finish_error(entry.line, line_error(failure))
        elif not entry.unfinished:
            self._finish_llm(entry)

    def _drop(self, entry: _LLMLine) -> None:
        """End a line's other prompts: one failed, so the line is an error line."""
        assert self.engine is not None
        rest = sorted(entry.unfinished)
        self.engine.abort_request(rest)
        for request_id in rest:
            del self._llm[request_id]
            self._in_flight -= entry.n
        entry.unfinished.clear()

    def _finish_llm(self, entry: _LLMLine) -> None:
        samples = [entry.samples[i] for i in sorted(entry.samples)]
        self.generated_tokens += sum(len(s.token_ids) for s in samples)
        tokenizer = self.engine.tokenizer if self.engine is not None else None
        record = llm_answer(self.job_id, entry.prepared, samples, entry.job, tokenizer)
        self._sink(entry.line, True, record)

    # --- embeddings --------------------------------------------------------------------------

    def _embed_chunk(self) -> None:
        """Encode queued lines together, up to `encoder_batch_size` inputs (at least one line)."""
        chunk = [self._embeddings.popleft()]
        size = len(chunk[0].token_ids)
        while self._embeddings and size + len(self._embeddings[0].token_ids) <= (
            self.encoder_batch_size
        ):
            entry = self._embeddings.popleft()
            chunk.append(entry)
            size += len(entry.token_ids)
        self._queued_inputs -= size
        self._encode(chunk)

    def _encode(self, chunk: list[_EmbeddingLine]) -> None:
        assert self.encoder is not None
        try:
            vectors = self.encoder.embed([ids for entry in chunk for ids in entry.token_ids])
        except Exception as exc:
            if len(chunk) > 1:  # find the line that fails: the others still get answers
                for entry in chunk:
                    self._encode([entry])
                return
            self._finish_error(chunk[0].line, line_error(exc))
            return
        start = 0
        for entry in chunk:
            rows = vectors[start : start + len(entry.token_ids)]
            start += len(entry.token_ids)
            record = embedding_answer(self.job_id, entry.line, entry.body, entry.token_ids, rows)
            self._sink(entry.line, True, record)

    def _finish_error(self, line: BatchLine, error: LineError) -> None:
        self._sink(line, False, error_line(self.job_id, line, error))
