"""OpenAI routes: parse → check limits → tokenize → engine → assemble or stream."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from qiao.api.errors import APIError, as_api_error
from qiao.api.limits import check_request_fields, resolve_max_tokens, to_sampling_params
from qiao.api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from qiao.api.serving import (
    Job,
    chat_logprobs,
    collect,
    completion_logprobs,
    now,
    stream_events,
    usage,
)
from qiao.outputs import CompletionOutput, Logprob

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = request.app.state
    return ModelList(
        data=[ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)]
    )


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = request.app.state
    _check_model(body.model, state.model_name)
    check_request_fields(body, state.settings)
    prompts = _completion_prompts(body, state)
    job = _start(request, body, prompts, body.logprobs, "prompt")
    request_id, created = f"cmpl-{uuid.uuid4().hex}", now()
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": state.model_name,
    }
    k = body.logprobs
    if body.stream:

        def chunks(
            index: int, delta: CompletionOutput, lps: list[dict[int, Logprob]] | None
        ) -> list[dict]:
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": completion_logprobs(delta.token_ids, lps or [], k)
                if k is not None
                else None,
                "finish_reason": delta.finish_reason,
            }
            return [{**base, "choices": [choice]}]

        return _sse(job, chunks, base, body)
    samples = await collect(job, request)
    choices = [
        {
            "index": s.index,
            "text": s.text,
            "logprobs": completion_logprobs(s.token_ids, s.logprobs, k) if k is not None else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]
    return {**base, "choices": choices, "usage": usage(job, samples)}


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = request.app.state
    _check_model(body.model, state.model_name)
    check_request_fields(body, state.settings)
    prompt_ids = _render_chat(body, state.engine.tokenizer)
    k = (body.top_logprobs or 0) if body.logprobs else None
    job = _start(request, body, [prompt_ids], k, "messages")
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", now()
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
    }
    if body.stream:
        first = [
            {
                **base,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            for i in range(body.n)
        ]

        def chunks(
            index: int, delta: CompletionOutput, lps: list[dict[int, Logprob]] | None
        ) -> list[dict]:
            choice = {
                "index": index,
                "delta": {"content": delta.text} if delta.text or not delta.finish_reason else {},
                "logprobs": chat_logprobs(delta.token_ids, lps or [], k) if k is not None else None,
                "finish_reason": delta.finish_reason,
            }
            return [{**base, "choices": [choice]}]

        return _sse(job, chunks, base, body, first)
    samples = await collect(job, request)
    choices = [
        {
            "index": s.index,
            "message": {"role": "assistant", "content": s.text},
            "logprobs": chat_logprobs(s.token_ids, s.logprobs, k) if k is not None else None,
            "finish_reason": s.finish_reason,
        }
        for s in samples
    ]
    return {**base, "object": "chat.completion", "choices": choices, "usage": usage(job, samples)}


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"model {requested!r} is not served here; available: {served!r}",
            param="model",
            code="model_not_found",
        )


def _completion_prompts(body: CompletionRequest, state: Any) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
        id_lists: list[list[int]] = []
    elif prompt and isinstance(prompt[0], str):
        texts = list(prompt)  # type: ignore[arg-type]
        id_lists = []
    elif prompt and isinstance(prompt[0], list):
        texts, id_lists = None, [list(p) for p in prompt]  # type: ignore[union-attr]
    else:
        texts, id_lists = None, [list(prompt)]  # type: ignore[arg-type]
    count = len(texts) if texts is not None else len(id_lists)
    if count == 0:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if count > state.settings.max_prompts:
        raise APIError(
            400,
            f"prompt: at most {state.settings.max_prompts} prompts per request, got {count}",
            param="prompt",
        )
    if texts is None:
        vocab = state.engine.vocab_size
        for ids in id_lists:
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        return id_lists
    tokenizer = state.engine.tokenizer
    return [tokenizer.encode(text) if text else [] for text in texts]


def _render_chat(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # jinja errors raised by the template itself (e.g. role order)
        raise APIError(
            400, f"messages: the model's chat template rejected them ({exc})", param="messages"
        ) from None
    # The template writes BOS and other special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


def _start(
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    num_logprobs: int | None,
    prompt_param: str,
) -> Job:
    """Check lengths for every prompt, then admit them all (or none) into the engine."""
    state = request.app.state
    engine, settings = state.engine, state.settings
    requested = body.max_tokens
    param = "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        requested, param = body.max_completion_tokens, "max_completion_tokens"
    budgets = [
        resolve_max_tokens(
            requested,
            len(p),
            engine.max_model_len,
            settings,
            prompt_param=prompt_param,
            param=param,
        )
        for p in prompts
    ]
    timeout = body.timeout or settings.default_timeout
    deadline = time.monotonic() + timeout if timeout else None
    if state.draining:
        raise APIError(
            503,
            "the server is shutting down; retry on another replica",
            code="unavailable",
            headers={"Retry-After": "1"},
        )
    streams = []
    params = to_sampling_params(body, budgets[0], num_logprobs)
    try:
        for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
            params_i = params if budget == params.max_tokens else params.clone(max_tokens=budget)
            streams.append(
                engine.generate(
                    f"{uuid.uuid4().hex}-{i}",
                    prompt,
                    params_i,
                    priority=body.priority,
                    deadline=deadline,
                )
            )
    except Exception as exc:  # e.g. the queue filled up part-way: admit all prompts or none
        for stream in streams:
            engine.abort(stream.request_id)
        raise as_api_error(exc) from None
    return Job(streams, [len(p) for p in prompts], body.n, num_logprobs)


def _sse(
    job: Job, chunks: Any, base: dict, body: Any, first: list[dict] | None = None
) -> StreamingResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def usage_chunk(u: dict[str, int]) -> dict:
        return {**base, "choices": [], "usage": u}

    return StreamingResponse(
        stream_events(job, chunks, usage_chunk if include_usage else None, first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
