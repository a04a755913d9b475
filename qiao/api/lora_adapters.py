"""LoRA adapters as the API names them (docs/lora.md).

A request picks an adapter with `"model": "base:adapter"`, or with the adapter's bare name as
vLLM does (when one served model has an adapter of that name). `/v1/models` lists each adapter
with its `parent`. The management API loads and unloads adapters at runtime
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, vLLM's routes and bodies, behind the
management token).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from qiao.api.errors import APIError
from qiao.api.protocol import ModelCard
from qiao.errors import ConfigError, ModelNotFoundError
from qiao.repository.scan import quoted
from qiao.repository.served import LLMVersion


def adapters_of(router: Any, name: str) -> dict[str, str]:
    """The adapters of served model `name` (name -> folder); none for an encoder or an
    unknown name."""
    try:
        served = router.get(name)
    except Exception:
        return {}
    return served.engine.lora_adapters() if isinstance(served, LLMVersion) else {}


def split_adapter(router: Any, model: str) -> tuple[str, str | None]:
    """`base:adapter` -> (base, adapter); an adapter's bare name -> (its model, adapter);
    anything else -> (model, None). 404 naming the loaded adapters when `base` has no such
    adapter; 400 when a bare name is an adapter of several models."""
    base, sep, adapter = model.partition(":")
    if sep:
        if base not in router.model_names():
            return base, adapter  # the model's own 404 follows
        known = adapters_of(router, base)
        if adapter not in known:
            raise APIError(
                404,
                f"model {quoted(model)}: {quoted(base)} has no LoRA adapter {quoted(adapter)} "
                f"(loaded: {', '.join(sorted(known)) or 'none'}); GET /v1/models lists them",
                param="model",
                code="model_not_found",
            )
        return base, adapter
    name = model.partition("@")[0]
    if name in router.model_names():
        return model, None
    owners = [m for m in router.model_names() if name in adapters_of(router, m)]
    if len(owners) > 1:
        raise APIError(
            400,
            f"model {quoted(model)}: a LoRA adapter of {', '.join(owners)}; name it as "
            f"'{owners[0]}:{name}'",
            param="model",
        )
    return (owners[0], name) if owners else (model, None)


def adapter_cards(router: Any, name: str, max_model_len: int | None) -> list[ModelCard]:
    """One card per adapter of model `name`, as vLLM lists them (`parent`: the base model)."""
    return [
        ModelCard(id=adapter, parent=name, max_model_len=max_model_len)
        for adapter in sorted(adapters_of(router, name))
    ]


class LoadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    # The served model to load it on; may be left out when one LLM is served.
    model: str | None = None


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's body may carry it; the name decides
    model: str | None = None


def add_management_routes(app: FastAPI, parse: Any, as_http: Any) -> None:
    """The management API's LoRA routes; `parse(request, Body, required=True)` reads a body,
    `as_http(exc)` maps an engine error to its answer (the management API's helpers)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        body = await parse(request, LoadLoRABody, required=True)
        try:
            model, engine = _engine(request, body.model)
            await engine.load_lora(body.lora_name, body.lora_path)
        except Exception as exc:
            raise as_http(exc) from None
        return {"model": model, "lora_name": body.lora_name, "adapters": _names(engine)}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        body = await parse(request, UnloadLoRABody, required=True)
        try:
            model, engine = _engine(request, body.model)
            await engine.unload_lora(body.lora_name)
        except Exception as exc:
            raise as_http(exc) from None
        return {"model": model, "lora_name": body.lora_name, "adapters": _names(engine)}


def _names(engine: Any) -> list[str]:
    return sorted(engine.lora_adapters())


def _engine(request: Request, model: str | None) -> tuple[str, Any]:
    router = request.app.state.control
    names = [n for n in router.model_names() if isinstance(_get(router, n), LLMVersion)]
    if model is None:
        if len(names) != 1:
            raise ConfigError(f"model: name the model to change ({', '.join(names)})")
        model = names[0]
    if model not in names:
        raise ModelNotFoundError(f"model {quoted(model)} is not a served LLM")
    return model, _get(router, model).engine


def _get(router: Any, name: str) -> Any:
    try:
        return router.get(name)
    except Exception:
        return None
