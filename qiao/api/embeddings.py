"""`POST /v1/embeddings` (OpenAI): texts or token ids → one vector per input, through the
model version's dynamic batcher."""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from qiao.api import response_cache
from qiao.api.errors import APIError, as_api_error
from qiao.api.keys import token_charger
from qiao.api.limits import split_inputs
from qiao.api.openai_routes import resolve_model
from qiao.logs import note_tokens
from qiao.repository.served import EncoderVersion

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # qiao extensions, as on the completion routes and KServe's parameters.
    priority: int | None = Field(None, ge=0, description="batcher priority level (1 = highest)")
    timeout_us: int | None = Field(None, ge=1, description="queue timeout (microseconds)")
    cache: bool = Field(True, description="false: neither read nor write the response cache")


@router.post("/v1/embeddings", response_model=None)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    settings = request.app.state.settings
    served = resolve_model(request, body.model, body.user)
    if not isinstance(served, EncoderVersion):
        raise APIError(
            400,
            f"model {body.model!r} is a generative model; use /v1/completions",
            param="model",
        )
    check_dimensions(body, served.encoder.dim)
    cache = await response_cache.lookup(
        request,
        served,
        "embeddings",
        lambda: body.model_dump(mode="json", exclude={"user", "priority", "timeout_us", "cache"}),
        skip=not body.cache,
    )
    if cache.hit is not None:
        return cache.hit_response()
    token_ids = embedding_token_ids(body, served.tokenize, settings.max_prompts)
    try:
        vectors = await served.embed_ids(
            token_ids, priority=body.priority, timeout_us=body.timeout_us
        )
    except Exception as exc:
        error = as_api_error(exc)
        if error.status_code == 400:
            error.param = error.param or "input"
        raise error from None
    num_tokens = sum(len(ids) for ids in token_ids)
    note_tokens(num_tokens)
    charge = token_charger(request)
    if charge is not None:
        charge(num_tokens)
    # A response object of plain JSON types: FastAPI's encoder would walk every float again.
    return await cache.respond(JSONResponse(embedding_body(body, vectors, num_tokens)))


def check_dimensions(body: EmbeddingRequest, dim: int) -> None:
    """`dimensions` may only ask for the model's own size (no truncation)."""
    if body.dimensions is not None and body.dimensions != dim:
        raise APIError(
            400,
            f"dimensions: this model returns {dim}-dimensional vectors only",
            param="dimensions",
        )


def embedding_body(body: EmbeddingRequest, vectors: np.ndarray, num_tokens: int) -> dict[str, Any]:
    """The response body: one vector per input, in the asked encoding."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, body.encoding_format)}
        for i, row in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def embedding_token_ids(
    body: EmbeddingRequest, tokenize: Callable[[list[str]], list[list[int]]], max_inputs: int
) -> list[list[int]]:
    """The inputs as token ids (texts through `tokenize`); 400 for empty or too many inputs."""
    texts, ids = split_inputs(body.input, param="input", noun="inputs", max_count=max_inputs)
    if texts is None and any(not row for row in ids):
        raise APIError(400, "input: must not be empty", param="input")
    if texts is not None:
        if any(not text for text in texts):
            raise APIError(400, "input: texts must not be empty strings", param="input")
        return tokenize(texts)
    return ids


def _encode(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()
