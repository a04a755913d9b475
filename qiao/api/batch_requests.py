"""A batch line as the HTTP route would take it: its body validated with the route's request
model and checked, its prompts and sampling parameters planned, and the answer assembled from
finished samples by the route's own functions. Shared by `qiao batch run` (an in-process
engine) and the server's Batch API (the served models), so a batch answer is the route's answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from qiao.api.embeddings import (
    EmbeddingRequest,
    check_dimensions,
    embedding_body,
    embedding_token_ids,
)
from qiao.api.errors import APIError, as_api_error, validation_message
from qiao.api.limits import check_request_fields
from qiao.api.openai_routes import (
    chat_fields,
    chat_top_logprobs,
    completion_choices,
    completion_prompts,
    plan_params,
    prepare_chat,
)
from qiao.api.protocol import ChatCompletionRequest, CompletionRequest
from qiao.api.serving import Job, Sample, usage
from qiao.api.tool_parsers import ToolParsing
from qiao.batch.lines import BatchLine, LineError, line_ids, response_line
from qiao.sampling_params import SamplingParams


@dataclass
class LLMLine:
    """A chat or completions line, ready for the engine: one request per prompt."""

    line: BatchLine
    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    parsing: ToolParsing | None
    num_top_logprobs: int | None

    def new_job(self) -> Job:
        return Job([], [len(p) for p in self.prompts], self.body.n, self.num_top_logprobs)


def prepare_llm(line: BatchLine, settings: Any, engine: Any, vocab_size: int) -> LLMLine:
    """Raises APIError (as the route would answer) for a body that cannot run. `engine` gives
    `tokenizer`, `max_model_len` and `max_sequence_tokens`."""
    body: CompletionRequest | ChatCompletionRequest
    parsing = None
    if line.url == "/v1/completions":
        body = validate(CompletionRequest, line.body)
        check_request_fields(body, settings)
        prompts = completion_prompts(body, settings, engine.tokenizer, vocab_size)
        k, prompt_param = body.logprobs, "prompt"
    else:
        body = validate(ChatCompletionRequest, line.body)
        check_request_fields(body, settings)
        body, prompt_ids, parsing = prepare_chat(body, settings, engine.tokenizer)
        prompts, k, prompt_param = [prompt_ids], chat_top_logprobs(body), "messages"
    params = plan_params(body, prompts, k, prompt_param, settings, engine)
    return LLMLine(line, body, prompts, params, parsing, k)


def llm_answer(
    job_id: str, prepared: LLMLine, samples: list[Sample], job: Job, tokenizer: Any
) -> dict[str, Any]:
    """The output-file line of a finished chat or completions line."""
    line, body = prepared.line, prepared.body
    _, request_id = line_ids(job_id, line.number)
    suffix = request_id.removeprefix("req_")
    base: dict[str, Any] = {"created": int(time.time()), "model": body.model}
    if isinstance(body, CompletionRequest):
        choices = completion_choices(body, prepared.prompts, samples, job, tokenizer)
        response = {"id": f"cmpl-{suffix}", "object": "text_completion", **base, "choices": choices}
    else:
        fields = chat_fields(body, samples, job, prepared.parsing)
        response = {"id": f"chatcmpl-{suffix}", "object": "chat.completion", **base, **fields}
    response["usage"] = usage(job, samples)
    return response_line(job_id, line, 200, response)


def prepare_embedding(
    line: BatchLine, settings: Any, encoder: Any
) -> tuple[EmbeddingRequest, list[list[int]]]:
    """An embeddings line's request and its inputs as token ids (`encoder` gives `dim` and
    `tokenize`)."""
    body = validate(EmbeddingRequest, line.body)
    check_dimensions(body, encoder.dim)
    return body, embedding_token_ids(body, encoder.tokenize, settings.max_prompts)


def embedding_answer(
    job_id: str,
    line: BatchLine,
    body: EmbeddingRequest,
    token_ids: list[list[int]],
    vectors: np.ndarray,
) -> dict[str, Any]:
    num_tokens = sum(len(ids) for ids in token_ids)
    return response_line(job_id, line, 200, embedding_body(body, vectors, num_tokens))


def validate(model: type[BaseModel], body: dict[str, Any] | None) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(400, message, param=param) from None


def line_error(exc: Exception) -> LineError:
    """What the route would have answered for `exc`, as a batch line's error."""
    error = as_api_error(exc)
    return LineError(error.status_code, error.message, error.param, error.code)
