"""Request limits and the wire → `SamplingParams` mapping, checked before any engine work.

Every breach raises `APIError(400, ...)` naming the field and the limit.
"""

from __future__ import annotations

from qiao.api.errors import APIError, as_api_error
from qiao.api.protocol import ChatCompletionRequest, CompletionRequest
from qiao.api.settings import ServeSettings
from qiao.api.structured import structured_outputs_of
from qiao.errors import ConfigError
from qiao.sampling_params import SamplingParams


def check_request_fields(
    req: CompletionRequest | ChatCompletionRequest, settings: ServeSettings
) -> None:
    """Limits that need no tokenization."""
    if req.n > settings.max_n:
        raise APIError(
            400, f"n: at most {settings.max_n} samples per prompt, got {req.n}", param="n"
        )
    stops = stop_list(req)
    if len(stops) > settings.max_stop_sequences:
        raise APIError(
            400,
            f"stop: at most {settings.max_stop_sequences} stop sequences, got {len(stops)}",
            param="stop",
        )
    for stop in stops:
        if not stop:
            raise APIError(400, "stop: stop sequences must not be empty", param="stop")
        if len(stop) > settings.max_stop_length:
            raise APIError(
                400,
                f"stop: each stop sequence is at most {settings.max_stop_length} characters, "
                f"got one of {len(stop)}",
                param="stop",
            )
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    _check_prompt_logprobs(req, settings)
    if (
        req.timeout is not None
        and settings.max_timeout is not None
        and req.timeout > settings.max_timeout
    ):
        raise APIError(
            400,
            f"timeout: at most {settings.max_timeout} seconds, got {req.timeout}",
            param="timeout",
        )
    if isinstance(req, CompletionRequest):
        _check_completion_fields(req, settings)
    else:
        _check_chat_fields(req, settings)


def _check_completion_fields(req: CompletionRequest, settings: ServeSettings) -> None:
    if req.logprobs is not None and req.logprobs > settings.max_top_logprobs:
        raise APIError(
            400,
            f"logprobs: at most {settings.max_top_logprobs}, got {req.logprobs}",
            param="logprobs",
        )
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400, "max_tokens: 0 needs echo: true (scoring the prompt alone)", param="max_tokens"
        )
    if req.echo and req.stream:
        raise APIError(400, "echo: not supported with stream: true", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of: only best_of == n is supported", param="best_of")


def _check_prompt_logprobs(
    req: CompletionRequest | ChatCompletionRequest, settings: ServeSettings
) -> None:
    if req.prompt_logprobs is None:
        return
    if req.prompt_logprobs > settings.max_top_logprobs:
        raise APIError(
            400,
            f"prompt_logprobs: at most {settings.max_top_logprobs}, got {req.prompt_logprobs}",
            param="prompt_logprobs",
        )
    if req.stream:
        raise APIError(
            400, "prompt_logprobs: not supported with stream: true", param="prompt_logprobs"
        )


def _check_chat_fields(req: ChatCompletionRequest, settings: ServeSettings) -> None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        if req.top_logprobs > settings.max_top_logprobs:
            raise APIError(
                400,
                f"top_logprobs: at most {settings.max_top_logprobs}, got {req.top_logprobs}",
                param="top_logprobs",
            )
    _check_tools(req)


def _check_tools(req: ChatCompletionRequest) -> None:
    """Function names unique; a tool_choice that calls for a tool names a listed one."""
    names: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        name = tool.function.name
        if name in names:
            param = f"tools.{i}.function.name"
            raise APIError(400, f"{param}: duplicate function name {name!r}", param=param)
        names.add(name)
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return
    if not names:
        raise APIError(
            400,
            "tool_choice: asks for a tool call but the request has no tools",
            param="tool_choice",
        )
    if not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice: function {choice.function.name!r} is not among the request's tools",
            param="tool_choice",
        )


def stop_list(req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def resolve_max_tokens(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    settings: ServeSettings,
    *,
    prompt_param: str,
    param: str,
    max_sequence_tokens: int | None = None,
) -> int:
    """New-token budget: what was asked, within the context, the KV cache (a sequence holds at
    most `max_sequence_tokens`) and the server's cap. Without a request, the most that fits."""
    if num_prompt_tokens == 0:
        raise APIError(400, f"{prompt_param}: must not be empty", param=prompt_param)
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(
            400,
            f"{prompt_param}: the prompt is {num_prompt_tokens} tokens but the model's context is "
            f"{max_model_len} tokens, leaving no room to generate",
            param=prompt_param,
        )
    limit = min(max_model_len, max_sequence_tokens or max_model_len)
    cache_room = limit - num_prompt_tokens
    if cache_room < 1:
        raise APIError(
            400,
            f"{prompt_param}: the prompt is {num_prompt_tokens} tokens but the KV cache holds "
            f"{limit} tokens of one sequence, leaving no room to generate",
            param=prompt_param,
        )
    cap = settings.max_tokens_limit
    if requested is None:
        return min(cache_room, cap) if cap is not None else cache_room
    if cap is not None and requested > cap:
        raise APIError(400, f"{param}: at most {cap} on this server, got {requested}", param=param)
    if requested > room:
        raise APIError(
            400,
            f"{param}: the prompt is {num_prompt_tokens} tokens and the context {max_model_len}, "
            f"so at most {room} new tokens fit; got {requested}",
            param=param,
        )
    if requested > cache_room:
        raise APIError(
            400,
            f"{param}: the prompt is {num_prompt_tokens} tokens and the KV cache holds {limit} "
            f"tokens of one sequence, so at most {cache_room} new tokens fit; got {requested}",
            param=param,
        )
    return requested


def prompt_logprobs_of(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-k of the prompt logprobs to compute: vLLM's `prompt_logprobs`, and `echo` with
    `logprobs` (the echoed prompt's tokens get logprobs too)."""
    asked = req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        asked = max(asked or 0, req.logprobs)
    return asked


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, num_logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens, max_tokens),
            stop=stop_list(req),
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=num_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured_outputs_of(req),
            prompt_logprobs=prompt_logprobs_of(req),
        )
    except ConfigError as exc:
        raise as_api_error(exc) from None


def split_inputs(
    value: str | list[str] | list[int] | list[list[int]],
    *,
    param: str,
    noun: str,
    max_count: int,
) -> tuple[list[str] | None, list[list[int]]]:
    """An OpenAI text-or-tokens field (`prompt`, `input`): a string, strings, token ids, or lists
    of token ids → (texts, None-for-ids) or (None, id lists); 400 when empty or over
    `max_count`."""
    if isinstance(value, str):
        texts: list[str] | None = [value]
        id_lists: list[list[int]] = []
    elif value and isinstance(value[0], str):
        texts, id_lists = list(value), []  # type: ignore[arg-type]
    elif value and isinstance(value[0], list):
        texts, id_lists = None, [list(v) for v in value]  # type: ignore[union-attr]
    else:
        texts, id_lists = None, [list(value)]  # type: ignore[arg-type]
    count = len(texts) if texts is not None else len(id_lists)
    if count == 0:
        raise APIError(400, f"{param}: must not be empty", param=param)
    if count > max_count:
        raise APIError(
            400, f"{param}: at most {max_count} {noun} per request, got {count}", param=param
        )
    return texts, id_lists
