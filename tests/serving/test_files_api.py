"""OpenAI's Files API through the official openai client: upload, list, retrieve, content,
delete; a key sees only its own files; the store survives a restart; bad uploads are 4xx."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import InProcessServer, openai_client

KEYS = ["sk-files-owner-0123456789", "sk-files-other-0123456789"]
BATCH = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files-data")


@pytest.fixture(scope="module")
def server(
    make_inprocess_server: Callable[..., InProcessServer], data_dir: Path
) -> InProcessServer:
    return make_inprocess_server(api_key=KEYS, data_dir=data_dir, max_file_bytes=4096)


def test_upload_list_retrieve_content_delete(server: InProcessServer, tmp_path: Path) -> None:
    client = openai_client(server.base_url, KEYS[0])
    source = tmp_path / "requests.jsonl"
    source.write_bytes(BATCH * 3)
    with source.open("rb") as file:
        created = client.files.create(file=file, purpose="batch")
    assert created.id.startswith("file-") and created.object == "file"
    assert (created.bytes, created.filename, created.purpose) == (
        len(BATCH) * 3,
        "requests.jsonl",
        "batch",
    )
    second = client.files.create(file=("more.jsonl", BATCH), purpose="batch")

    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).content == BATCH * 3
    listed = client.files.list()
    assert [f.id for f in listed.data] == [second.id, created.id]  # newest first
    assert [f.id for f in client.files.list(order="asc").data] == [created.id, second.id]
    page = client.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    after = client.files.list(limit=1, after=second.id)
    assert [f.id for f in after.data] == [created.id] and not after.has_more

    deleted = client.files.delete(second.id)
    assert (deleted.id, deleted.deleted) == (second.id, True)
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.retrieve(second.id)
    assert missing.value.body["code"] == "file_not_found"
    with pytest.raises(openai.NotFoundError):
        client.files.delete(second.id)


def test_a_key_sees_only_its_own_files(server: InProcessServer) -> None:
    owner = openai_client(server.base_url, KEYS[0])
    other = openai_client(server.base_url, KEYS[1])
    mine = owner.files.create(file=("mine.jsonl", BATCH), purpose="batch")
    assert mine.id not in [f.id for f in other.files.list().data]
    for call in (other.files.retrieve, other.files.content, other.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    assert owner.files.retrieve(mine.id).id == mine.id


def test_bad_uploads_are_4xx_naming_the_problem(server: InProcessServer) -> None:
    client = openai_client(server.base_url, KEYS[0])
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", BATCH), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as large:
        client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert "4096 bytes" in large.value.body["message"]
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=server.base_url, headers=headers) as http:
        no_file = http.post("/v1/files", data={"purpose": "batch"})
        assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
        huge = http.post(
            "/v1/files", content=b"x" * 200_000, headers={"Content-Type": "multipart/form-data"}
        )
        assert huge.status_code == 413
        assert http.get("/v1/files", params={"order": "sideways"}).status_code == 400


def test_files_survive_a_restart(
    make_inprocess_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    first = make_inprocess_server(data_dir=tmp_path)
    kept = openai_client(first.base_url).files.create(file=("kept.jsonl", BATCH), purpose="batch")
    first.stop()
    second = make_inprocess_server(data_dir=tmp_path)
    client = openai_client(second.base_url)
    assert client.files.retrieve(kept.id) == kept
    assert client.files.content(kept.id).content == BATCH
