"""OpenAI routes: parse → check limits → tokenize → engine → assemble or stream."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from qiao.api import response_cache
from qiao.api.errors import APIError, as_api_error
from qiao.api.keys import check_model_allowed, priority_for, token_charger
from qiao.api.limits import (
    check_request_fields,
    resolve_max_tokens,
    split_inputs,
    to_sampling_params,
)
from qiao.api.lora_adapters import adapter_cards, split_adapter
from qiao.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    template_messages,
)
from qiao.api.serving import (
    Job,
    Sample,
    chat_logprobs,
    collect,
    completion_logprobs,
    echo_logprobs,
    now,
    prompt_logprobs_json,
    stream_events,
    usage,
)
from qiao.api.tool_parsers import ParsedText, ToolCallParser, ToolParsing, tool_parsing
from qiao.engine.async_engine import GenerateRequest
from qiao.outputs import CompletionOutput, Logprob
from qiao.repository.manager import ModelManager
from qiao.repository.scan import MAX_VERSION_LENGTH, quoted
from qiao.repository.served import LLMVersion
from qiao.sampling_params import SamplingParams

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """Served models, generative ones first (tools that take the first model get an LLM)."""
    manager: ModelManager = request.app.state.router
    cards = [_card(manager, name) for name in manager.model_names()]
    cards.sort(key=lambda card: card.max_model_len is None)  # stable: names stay sorted
    adapters = [a for c in cards for a in adapter_cards(manager, c.id, c.max_model_len)]
    return ModelList(data=cards + adapters)


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> ModelCard:
    """One served model (`model@version` names a version); 404 when it is not served."""
    manager: ModelManager = request.app.state.router
    base, adapter = split_adapter(manager, model_id)
    if adapter is not None and base in manager.model_names():
        card = _card(manager, base)
        return card.model_copy(update={"id": model_id, "parent": base})
    name, version = split_model_id(model_id)
    if name not in manager.model_names() or (
        version is not None and version not in manager.ready_versions(name)
    ):
        raise APIError(
            404,
            f"model {quoted(model_id)} is not served; GET /v1/models lists them",
            param="model",
            code="model_not_found",
        )
    card = _card(manager, name)
    return card.model_copy(update={"id": model_id})


def _card(manager: ModelManager, name: str) -> ModelCard:
    served = manager.get(name)
    max_len = served.engine.max_model_len if isinstance(served, LLMVersion) else None
    return ModelCard(id=name, max_model_len=max_len)


def split_model_id(model: str) -> tuple[str, str | None]:
    """`name@version` → (name, version); a bare name → (name, None)."""
    name, sep, version = model.partition("@")
    if not sep:
        return name, None
    canonical = version.lstrip("0") or "0" if version.isascii() and version.isdigit() else ""
    if not canonical or len(canonical) > MAX_VERSION_LENGTH:
        raise APIError(
            400,
            f"model: version {quoted(version)} after '@' must be a number of at most "
            f"{MAX_VERSION_LENGTH} digits",
            param="model",
        )
    return name, canonical


def resolve_model(request: Request, model: str, user: str | None) -> Any:
    """The served version that takes this request (pinned by `name@version`, else by the
    traffic weights, sticky per `user`)."""
    name, version = split_model_id(model)
    check_model_allowed(request, name)
    try:
        return request.app.state.router.get(name, version, user=user)
    except Exception as exc:
        error = as_api_error(exc)
        error.param = error.param or "model"
        raise error from None


def _llm(request: Request, body: CompletionRequest | ChatCompletionRequest) -> LLMVersion:
    base, _ = split_adapter(request.app.state.router, body.model)
    served = resolve_model(request, base, body.user)
    if not isinstance(served, LLMVersion):
        raise APIError(
            400,
            f"model {body.model!r} is an embedding model; use /v1/embeddings",
            param="model",
        )
    return served


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = request.app.state
    served = _llm(request, body)
    check_request_fields(body, state.settings)
    cache = await _cache_lookup(request, served, "completions", body)
    if cache.hit is not None:
        return cache.replay(body)
    engine = served.engine
    prompts = completion_prompts(body, state.settings, engine.tokenizer, engine.vocab_size)
    job = _start(request, engine, body, prompts, body.logprobs, "prompt")
    request_id, created = f"cmpl-{uuid.uuid4().hex}", now()
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": body.model,
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

        return cache.mark(_sse(job, chunks, base, body))
    samples = await collect(job, request)
    choices = completion_choices(body, prompts, samples, job, engine.tokenizer)
    return await cache.respond_json({**base, "choices": choices, "usage": usage(job, samples)})


async def _cache_lookup(
    request: Request,
    served: LLMVersion,
    route: str,
    body: CompletionRequest | ChatCompletionRequest,
) -> response_cache.Lookup:
    """The response cache's answer for a greedy or seeded request (qiao/api/response_cache.py)."""
    adapter = split_adapter(request.app.state.router, body.model)[1]

    def fields() -> dict[str, Any]:
        lora = response_cache.adapter_identity(served.engine, adapter)
        return {**response_cache.body_fields(body), "lora": lora}

    return await response_cache.lookup(
        request, served, route, fields, cacheable=response_cache.is_deterministic(body)
    )


def completion_choices(
    body: CompletionRequest,
    prompts: list[list[int]],
    samples: list[Sample],
    job: Job,
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """The `choices` of a finished completions request (echo and logprobs included)."""
    k = body.logprobs
    choices = []
    for s in samples:
        prompt_index = s.index // body.n
        prompt = prompts[prompt_index]
        if body.max_tokens == 0:  # the prompt scored alone: the one token it ran for is dropped
            s.text, s.token_ids, s.logprobs, s.finish_reason = "", [], [], "length"
        choice: dict[str, Any] = {"index": s.index, "text": s.text, "logprobs": None}
        if body.echo:
            echoed = _prompt_text(body, prompt_index, prompt, tokenizer)
            choice["text"] = echoed + s.text
            if k is not None:
                first = tokenizer.decode(prompt[:1]) if tokenizer is not None else ""
                choice["logprobs"] = echo_logprobs(
                    prompt, job.prompt_logprobs[prompt_index], first, s.token_ids, s.logprobs, k
                )
        elif k is not None:
            choice["logprobs"] = completion_logprobs(s.token_ids, s.logprobs, k)
        choice["finish_reason"] = s.finish_reason
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(job.prompt_logprobs.get(prompt_index))
        choices.append(choice)
    return choices


def _prompt_text(body: CompletionRequest, index: int, prompt: list[int], tokenizer: Any) -> str:
    """The prompt as echoed: its text as sent, or its token ids decoded."""
    if isinstance(body.prompt, str):
        return body.prompt
    if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
        return str(body.prompt[index])
    return tokenizer.decode(prompt) if tokenizer is not None else ""


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = request.app.state
    served = _llm(request, body)
    check_request_fields(body, state.settings)
    cache = await _cache_lookup(request, served, "chat", body)
    if cache.hit is not None:
        return cache.replay(body)
    body, prompt_ids, parsing = prepare_chat(body, state.settings, served.engine.tokenizer)
    k = chat_top_logprobs(body)
    job = _start(request, served.engine, body, [prompt_ids], k, "messages")
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", now()
    base = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": body.model,
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
        parsers: dict[int, ToolCallParser] = {}  # one per choice

        def chunks(
            index: int, delta: CompletionOutput, lps: list[dict[int, Logprob]] | None
        ) -> list[dict]:
            lp = chat_logprobs(delta.token_ids, lps or [], k) if k is not None else None
            reason = delta.finish_reason
            if parsing is None:
                deltas = [{"content": delta.text} if delta.text or not reason else {}]
            else:
                if index not in parsers:
                    parsers[index] = parsing.new()
                parser = parsers[index]
                parsed = parser.feed(delta.text)
                if reason is not None:
                    parsed += parser.finish()
                    reason = _finish_reason(reason, parser.num_calls)
                deltas = _stream_deltas(parsed) or ([{}] if reason or lp is not None else [])
            return [
                {
                    **base,
                    "choices": [
                        {
                            "index": index,
                            "delta": d,
                            "logprobs": lp if i == 0 else None,
                            "finish_reason": reason if i == len(deltas) - 1 else None,
                        }
                    ],
                }
                for i, d in enumerate(deltas)
            ]

        return cache.mark(_sse(job, chunks, base, body, first))
    samples = await collect(job, request)
    response = {**base, "object": "chat.completion", **chat_fields(body, samples, job, parsing)}
    return await cache.respond_json({**response, "usage": usage(job, samples)})


def prepare_chat(
    body: ChatCompletionRequest, settings: Any, tokenizer: Any
) -> tuple[ChatCompletionRequest, list[int], ToolParsing | None]:
    """The request as it runs (special tokens kept when its tool-call parser reads them), its
    rendered prompt, and how its outputs are parsed for tool calls."""
    prompt_ids = render_chat(body, tokenizer)
    parsing = tool_parsing_for(body, settings, tokenizer)
    if parsing is not None and parsing.keeps_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})
    return body, prompt_ids, parsing


def chat_top_logprobs(body: ChatCompletionRequest) -> int | None:
    """Top-k logprobs per sampled token; None when `logprobs` is not asked."""
    return (body.top_logprobs or 0) if body.logprobs else None


def chat_fields(
    body: ChatCompletionRequest, samples: list[Sample], job: Job, parsing: ToolParsing | None
) -> dict[str, Any]:
    """`choices` (and `prompt_logprobs` when asked) of a finished chat request."""
    k = chat_top_logprobs(body)
    choices = []
    for s in samples:
        message, reason = _chat_message(s.text, s.finish_reason, parsing)
        lp = chat_logprobs(s.token_ids, s.logprobs, k) if k is not None else None
        choices.append(
            {"index": s.index, "message": message, "logprobs": lp, "finish_reason": reason}
        )
    fields: dict[str, Any] = {"choices": choices}
    if body.prompt_logprobs is not None:
        fields["prompt_logprobs"] = prompt_logprobs_json(job.prompt_logprobs.get(0))
    return fields


def tool_parsing_for(
    body: ChatCompletionRequest, settings: Any, tokenizer: Any
) -> ToolParsing | None:
    """How this request's outputs are parsed for tool calls; None: not at all. With
    `tool_choice: "none"` the tools still reach the template (as vLLM does), but no output is
    parsed. `required` and a named function parse as `auto` until the output is constrained to
    `tool_call_schema`: an output without a call is then content, finish_reason "stop"."""
    if not body.tools or body.effective_tool_choice == "none":
        return None
    return tool_parsing(
        settings.tool_call_parser,
        tokenizer,
        parallel_tool_calls=body.parallel_tool_calls,
        skip_special_tokens=body.skip_special_tokens,
    )


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if reason == "stop" and num_calls else reason


def _chat_message(
    text: str, reason: str | None, parsing: ToolParsing | None
) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole output, and its finish_reason."""
    if parsing is None:
        return {"role": "assistant", "content": text}, reason
    parser = parsing.new()
    parsed = parser.parse(text)
    if not parsed.calls:
        return {"role": "assistant", "content": parsed.content}, reason
    message = {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": [call.to_openai() for call in parsed.calls],
    }
    return message, _finish_reason(reason, parser.num_calls)


def _stream_deltas(parsed: ParsedText) -> list[dict[str, Any]]:
    """Chunk deltas for parsed output, as OpenAI streams them: content, then per call a delta
    with its index, id, type, name and empty arguments, then one with the arguments."""
    deltas: list[dict[str, Any]] = [{"content": parsed.content}] if parsed.content else []
    for call in parsed.calls:
        head = call.to_openai()
        head["function"]["arguments"] = ""
        deltas.append({"tool_calls": [{"index": call.index, **head}]})
        args = {"index": call.index, "function": {"arguments": call.arguments}}
        deltas.append({"tool_calls": [args]})
    return deltas


def completion_prompts(
    body: CompletionRequest, settings: Any, tokenizer: Any, vocab_size: int
) -> list[list[int]]:
    """The request's prompts as token ids (texts encoded, ids checked against the vocabulary)."""
    texts, id_lists = split_inputs(
        body.prompt, param="prompt", noun="prompts", max_count=settings.max_prompts
    )
    if texts is None:
        for ids in id_lists:
            if any(not 0 <= t < vocab_size for t in ids):
                raise APIError(
                    400, f"prompt: token ids must be in [0, {vocab_size})", param="prompt"
                )
        return id_lists
    return [tokenizer.encode(text) if text else [] for text in texts]


def render_chat(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    # Tools go to the template whole ({"type": "function", "function": {...}}), as transformers
    # hands them over; a template without tool support ignores them.
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    try:
        text = tokenizer.apply_chat_template(
            template_messages(body.messages),
            tools=tools or None,
            add_generation_prompt=body.add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # jinja errors raised by the template itself (e.g. role order)
        raise APIError(
            400, f"messages: the model's chat template rejected them ({exc})", param="messages"
        ) from None
    # The template writes BOS and other special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


def _start(
    request: Request,
    engine: Any,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    num_logprobs: int | None,
    prompt_param: str,
) -> Job:
    """Check lengths for every prompt, then admit them all (or none) into the engine."""
    state = request.app.state
    settings = state.settings
    plans = plan_params(body, prompts, num_logprobs, prompt_param, settings, engine)
    timeout = body.timeout or settings.default_timeout
    deadline = time.monotonic() + timeout if timeout else None
    if state.draining:
        raise APIError(
            503,
            "the server is shutting down; retry on another replica",
            code="unavailable",
            headers={"Retry-After": "1"},
        )
    requests = [
        GenerateRequest(
            f"{uuid.uuid4().hex}-{i}",
            prompt,
            params,
            priority=priority_for(request, body.priority),
            deadline=deadline,
            lora_name=split_adapter(state.router, body.model)[1],
        )
        for i, (prompt, params) in enumerate(zip(prompts, plans, strict=True))
    ]
    try:
        streams = engine.generate_all(requests)  # every prompt admitted, or none
    except Exception as exc:
        raise as_api_error(exc) from None
    return Job(
        streams, [len(p) for p in prompts], body.n, num_logprobs, deadline, token_charger(request)
    )


def plan_params(
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    num_logprobs: int | None,
    prompt_param: str,
    settings: Any,
    engine: Any,
) -> list[SamplingParams]:
    """Each prompt's sampling parameters, its new-token budget checked against the context, the
    KV cache and the server's cap (400 naming the field that does not fit)."""
    requested = body.max_tokens
    if requested == 0:  # echo scoring the prompt alone: run one token, answer none
        requested = 1
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
            max_sequence_tokens=engine.max_sequence_tokens,
        )
        for p in prompts
    ]
    params = to_sampling_params(body, budgets[0], num_logprobs)
    return [
        params if budget == params.max_tokens else params.clone(max_tokens=budget)
        for budget in budgets
    ]


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
