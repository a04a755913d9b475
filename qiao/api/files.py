"""OpenAI's Files API: `POST /v1/files` (multipart `file` + `purpose`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.

Files live in the store under `--data-dir` (created on first use), owned by the API key that
uploaded them (its name; everyone's when the server has no keys): a key sees only its own.
Uploads may be up to `--max-file-bytes`, past the general `--max-request-bytes`.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from qiao.api.errors import APIError, as_api_error
from qiao.api.keys import key_of
from qiao.batch.store import FILE_PURPOSES, BatchStore, StoredFile

router = APIRouter()
_store_lock = threading.Lock()
# Multipart framing around the file's bytes (boundaries, part headers, the purpose field).
MULTIPART_SLACK_BYTES = 64 * 1024


def store_of(request: Request) -> BatchStore:
    """The app's store, opened on first use."""
    return store_for(request.app.state)


def store_for(state: Any) -> BatchStore:
    """The store of an app's `state`, opened on first use."""
    store = getattr(state, "store", None)
    if store is None:
        with _store_lock:
            store = getattr(state, "store", None)
            if store is None:
                store = state.store = BatchStore(state.settings.data_dir)
    return store


def owner_of(request: Request) -> str:
    key = key_of(request)
    return key.name if key is not None else ""


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page of objects with ids."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def file_not_found(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"no file {file_id!r}", param=param, code="file_not_found")


def get_owned_file(request: Request, file_id: str) -> StoredFile:
    stored = store_of(request).get_file(owner_of(request), file_id)
    if stored is None:
        raise file_not_found(file_id)
    return stored


@router.post("/v1/files")
async def create_file(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> dict[str, Any]:
    if purpose not in FILE_PURPOSES or purpose == "batch_output":
        raise APIError(
            400,
            f"purpose: {purpose!r} is not supported; this server takes 'batch'",
            param="purpose",
        )
    settings = request.app.state.settings
    store = store_of(request)
    try:
        stored = await run_in_threadpool(
            store.add_file,
            owner_of(request),
            purpose,
            file.filename or "upload.jsonl",
            file.file,
            settings.max_file_bytes,
        )
    except Exception as exc:
        raise as_api_error(exc) from None
    finally:
        await file.close()
    return stored.to_openai()


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = Query(10000, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    try:
        files, has_more = store_of(request).list_files(
            owner_of(request), purpose=purpose, limit=limit, order=order, after=after
        )
    except Exception as exc:
        raise as_api_error(exc) from None
    return list_page([f.to_openai() for f in files], has_more)


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    return get_owned_file(request, file_id).to_openai()


@router.get("/v1/files/{file_id}/content", response_model=None)
async def file_content(request: Request, file_id: str) -> FileResponse:
    stored = get_owned_file(request, file_id)
    return FileResponse(
        store_of(request).file_path(stored),
        media_type="application/octet-stream",
        filename=stored.filename,
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    if not store_of(request).delete_file(owner_of(request), file_id):
        raise file_not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}
