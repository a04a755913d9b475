"""The management API (`create_management_app`) against a fake `ModelControl`, served by uvicorn
on 127.0.0.1: auth, name checks on raw paths, error mapping, body limits, and tritonclient's
repository index / load / unload."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import tritonclient.http as triton_http
import uvicorn
from tritonclient.utils import InferenceServerException

from qiao.api.management import create_management_app
from qiao.errors import ConfigError, EngineUnavailableError, ModelNotFoundError
from qiao.repository.scan import NAME_RULE
from qiao.repository.types import VersionState, VersionStatus

from .conftest import STOP_TIMEOUT_S, find_leaks, http_client, wait_until

TOKEN = "s3cret-management-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROWS = [
    VersionStatus("chat", "1", VersionState.UNAVAILABLE, "cannot read /work/models/chat/1/x"),
    VersionStatus("chat", "2", VersionState.UNLOADING),
    VersionStatus("embed", "1", VersionState.READY),
    VersionStatus("embed", "2", VersionState.LOADING),
]


class FakeControl:
    """Records every call; model names pick the outcome."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, float] | None]] = []

    def index(self) -> list[VersionStatus]:
        return list(ROWS)

    async def load(self, model: str) -> None:
        self._call("load", model)

    async def unload(self, model: str) -> None:
        self._call("unload", model)

    def set_traffic(self, model: str, weights: dict[str, float]) -> None:
        self._call("traffic", model, weights)

    def _call(self, action: str, model: str, weights: dict[str, float] | None = None) -> None:
        self.calls.append((action, model, weights))
        if model == "missing":
            raise ModelNotFoundError(f"model {model!r} is not in the repository")
        if model == "broken":
            raise ConfigError("models/broken/config.yaml: backend: Input should be 'llm'")
        if model == "draining":
            raise EngineUnavailableError("the server is shutting down")
        if model == "explode":
            raise RuntimeError("boom in /work/main/qiao/secret.py talking to 10.0.0.7:8001")


class LiveServer:
    def __init__(self, control: FakeControl) -> None:
        app = create_management_app(control, token=TOKEN)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        wait_until(lambda: self.server.started or not self._thread.is_alive(), 30.0, "uvicorn")
        assert self.server.started

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S)
        self._socket.close()
        assert not self._thread.is_alive()


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[LiveServer, FakeControl]]:
    control = FakeControl()
    server = LiveServer(control)
    yield server, control
    server.stop()


@pytest.fixture
def control(live: tuple[LiveServer, FakeControl]) -> FakeControl:
    live[1].calls.clear()
    return live[1]


@pytest.fixture
def client(live: tuple[LiveServer, FakeControl]) -> Iterator[httpx.Client]:
    with http_client(live[0].base_url, timeout=10.0) as c:
        yield c


def raw_request(port: int, request_line: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send one request exactly as given (no client-side path normalisation)."""
    head = request_line + b"\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + TOKEN.encode()
    head += b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


# --- auth ---------------------------------------------------------------------------------------

ROUTES = [
    ("GET", "/v1/repository"),
    ("POST", "/v1/repository/models/embed/load"),
    ("POST", "/v1/repository/models/embed/reload"),
    ("POST", "/v1/repository/models/embed/unload"),
    ("PUT", "/v1/repository/models/embed/traffic"),
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/embed/load"),
    ("POST", "/v2/repository/models/embed/unload"),
    ("GET", "/no/such/route"),
    ("GET", "/docs"),
]
BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong-token"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN},
    {"Authorization": "Bearer"},
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("headers", BAD_AUTH)
def test_every_route_needs_the_token(
    client: httpx.Client, control: FakeControl, method: str, path: str, headers: dict
) -> None:
    response = client.request(method, path, headers=headers, json={"weights": {"1": 1}})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert control.calls == []


def test_the_right_token_works(client: httpx.Client, control: FakeControl) -> None:
    response = client.get("/v1/repository", headers=AUTH)
    assert response.status_code == 200
    # The scheme is case-insensitive (RFC 7235).
    lower = {"Authorization": f"bearer {TOKEN}"}
    assert client.post("/v1/repository/models/embed/load", headers=lower).status_code == 200
    assert control.calls == [("load", "embed", None)]


@pytest.mark.parametrize("token", ["", " padded ", "has space", "tab\there", "caf\u00e9"])
def test_the_token_must_be_usable(token: str) -> None:
    with pytest.raises(ConfigError, match="token"):
        create_management_app(FakeControl(), token=token)


# --- v1 routes ------------------------------------------------------------------------------


def test_repository_index(client: httpx.Client) -> None:
    response = client.get("/v1/repository", headers=AUTH)
    assert response.status_code == 200
    models = response.json()["models"]
    assert [(m["name"], m["version"], m["state"]) for m in models] == [
        ("chat", "1", "unavailable"),
        ("chat", "2", "unloading"),
        ("embed", "1", "ready"),
        ("embed", "2", "loading"),
    ]
    # The reason keeps its meaning but not the server's file path.
    assert models[0]["reason"] == "cannot read <path>"


@pytest.mark.parametrize(("action", "called"), [("load", "load"), ("reload", "load")])
def test_load_and_reload(
    client: httpx.Client, control: FakeControl, action: str, called: str
) -> None:
    response = client.post(f"/v1/repository/models/embed/{action}", headers=AUTH)
    assert response.status_code == 200
    assert response.json() == {
        "name": "embed",
        "versions": [
            {"name": "embed", "version": "1", "state": "ready", "reason": ""},
            {"name": "embed", "version": "2", "state": "loading", "reason": ""},
        ],
    }
    assert control.calls == [(called, "embed", None)]


def test_unload(client: httpx.Client, control: FakeControl) -> None:
    response = client.post("/v1/repository/models/chat/unload", headers=AUTH)
    assert response.status_code == 200
    assert [v["version"] for v in response.json()["versions"]] == ["1", "2"]
    assert control.calls == [("unload", "chat", None)]


def test_traffic(client: httpx.Client, control: FakeControl) -> None:
    body = {"weights": {"1": 90, "2": 10.5}}
    response = client.put("/v1/repository/models/embed/traffic", headers=AUTH, json=body)
    assert response.status_code == 200
    assert response.json() == {"name": "embed", "weights": {"1": 90.0, "2": 10.5}}
    assert control.calls == [("traffic", "embed", {"1": 90.0, "2": 10.5})]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (None, "a JSON object is required"),
        ({}, "weights"),
        ({"weights": {}}, "weights"),
        ({"weights": {"1": -1}}, "weights.1"),
        ({"weights": {"1": 0, "2": 0}}, "at least one weight must be > 0"),
        ({"weights": {"v1": 1}}, "version 'v1' is not allowed"),
        ({"weights": {"01": 1}}, "version '01' is not allowed"),
        ({"weights": {"..": 1}}, "version '..' is not allowed"),
        ({"weights": {"1": True}}, "weights.1"),
        ({"weights": {"1": "90"}}, "weights.1"),
        ({"weights": {"1": 1}, "extra": 1}, "extra: unknown key"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_traffic_bodies_are_400(
    client: httpx.Client, control: FakeControl, body: object, expected: str
) -> None:
    response = client.put("/v1/repository/models/embed/traffic", headers=AUTH, json=body)
    assert response.status_code == 400
    assert expected in response.json()["error"]["message"]
    assert control.calls == []


def test_traffic_body_not_json(client: httpx.Client, control: FakeControl) -> None:
    response = client.put(
        "/v1/repository/models/embed/traffic", headers=AUTH, content=b"{weights: 1"
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "request body is not valid JSON"
    assert control.calls == []


@pytest.mark.parametrize(
    ("model", "status", "expected"),
    [
        ("missing", 404, "model 'missing' is not in the repository"),
        ("broken", 400, "models/broken/config.yaml: backend: Input should be 'llm'"),
        ("draining", 503, "the server is shutting down"),
    ],
)
def test_control_errors_map_to_status(
    client: httpx.Client, model: str, status: int, expected: str
) -> None:
    response = client.post(f"/v1/repository/models/{model}/load", headers=AUTH)
    assert response.status_code == status
    assert response.json()["error"]["message"] == expected
    v2 = client.post(f"/v2/repository/models/{model}/load", headers=AUTH)
    assert v2.status_code == status
    assert v2.json() == {"error": expected}


@pytest.mark.logs_errors
def test_unexpected_errors_are_a_generic_500(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    for path in ("/v1/repository/models/explode/load", "/v2/repository/models/explode/unload"):
        response = client.post(path, headers=AUTH)
        assert response.status_code == 500
        assert "boom" not in response.text and "10.0.0.7" not in response.text
    assert "internal server error" in response.json()["error"]
    assert any("boom" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


# --- names and paths --------------------------------------------------------------------------

RAW_BAD_PATHS = [
    b"POST /v1/repository/models/..%2F..%2Fetc/load",
    b"POST /v1/repository/models/..%2f..%2fetc/load",
    b"POST /v1/repository/models/%2e%2e/load",
    b"POST /v1/repository/models/%2E%2E%2F%2E%2E/unload",
    b"POST /v1/repository/models/%2Fetc%2Fpasswd/load",
    b"POST /v1/repository/models/a%00b/load",
    b"POST /v1/repository/models/a%20b/load",
    b"POST /v1/repository/models/%D0%B0bc/load",  # Cyrillic a
    b"POST /v1/repository/models/a%5Cb/load",
    b"POST /v1/repository/models/../load",
    b"POST /v1/repository/models/../../etc/load",
    b"POST /v1/repository/models/./reload",
    b"POST /v1/repository/models/.hidden/load",
    b"POST /v1/repository/models/-dash/unload",
    b"POST /v1/repository/models/" + b"a" * 129 + b"/load",
    b"PUT /v1/repository/models/../traffic",
    b"POST /v2/repository/models/..%2F..%2Fetc/load",
    b"POST /v2/repository/models/../unload",
    b"POST /v2/repository/models/%2e%2e/load",
    b"POST /v2/repository/models//load",
]


@pytest.mark.parametrize("request_line", RAW_BAD_PATHS, ids=lambda b: b.decode()[:60])
def test_bad_names_never_reach_the_control(
    live: tuple[LiveServer, FakeControl], control: FakeControl, request_line: bytes
) -> None:
    body = b'{"weights": {"1": 1}}' if request_line.startswith(b"PUT") else b""
    status, response_body = raw_request(live[0].port, request_line + b" HTTP/1.1", body)
    assert 400 <= status < 500
    assert control.calls == []
    assert find_leaks(response_body) == []
    assert b"etc" not in response_body  # the bad name is not echoed back


def test_a_nul_byte_in_the_request_line_is_refused(
    live: tuple[LiveServer, FakeControl], control: FakeControl
) -> None:
    status, _ = raw_request(live[0].port, b"POST /v1/repository/models/a\x00b/load HTTP/1.1")
    assert 400 <= status < 500
    assert control.calls == []


def test_a_bad_name_reaching_a_route_gets_the_rule(
    client: httpx.Client, control: FakeControl
) -> None:
    response = client.post("/v1/repository/models/.hidden/load", headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"model name: use {NAME_RULE}"
    encoded = client.post("/v1/repository/models/..%2Fetc/load", headers=AUTH)
    assert encoded.status_code == 400
    assert "percent-encoded" in encoded.json()["error"]["message"]
    assert control.calls == []


# --- bodies -------------------------------------------------------------------------------------


def test_bodies_over_64_kib_are_413(client: httpx.Client, control: FakeControl) -> None:
    big = b'{"weights": {"1": 1}, "pad": "' + b"x" * (64 * 1024) + b'"}'
    response = client.put("/v1/repository/models/embed/traffic", headers=AUTH, content=big)
    assert response.status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"ready": true, "pad": "'
        for _ in range(70):
            yield b"y" * 1024
        yield b'"}'

    streamed = client.post("/v2/repository/index", headers=AUTH, content=chunks())
    assert streamed.status_code == 413
    assert "limit" in streamed.json()["error"]
    assert control.calls == []


def test_v2_index_bodies(client: httpx.Client) -> None:
    ready = client.post("/v2/repository/index", headers=AUTH, json={"ready": True})
    assert ready.json() == [{"name": "embed", "version": "1", "state": "READY", "reason": ""}]
    assert client.post("/v2/repository/index", headers=AUTH, json={"ready": "yes"}).status_code == (
        400
    )
    assert client.post("/v2/repository/index", headers=AUTH, content=b"[").status_code == 400


def test_v2_load_refuses_config_overrides(client: httpx.Client, control: FakeControl) -> None:
    body = {"parameters": {"config": '{"backend": "onnx"}', "file:1/model.onnx": "AAAA"}}
    response = client.post("/v2/repository/models/embed/load", headers=AUTH, json=body)
    assert response.status_code == 400
    assert "not accepted" in response.json()["error"]
    assert control.calls == []


# --- tritonclient -----------------------------------------------------------------------------


@pytest.fixture
def triton(live: tuple[LiveServer, FakeControl]) -> Iterator[triton_http.InferenceServerClient]:
    client = triton_http.InferenceServerClient(url=f"127.0.0.1:{live[0].port}")
    yield client
    client.close()


def test_tritonclient_repository_index(triton: triton_http.InferenceServerClient) -> None:
    index = triton.get_model_repository_index(headers=AUTH)
    assert index == [
        {"name": "chat", "version": "1", "state": "UNAVAILABLE", "reason": "cannot read <path>"},
        {"name": "chat", "version": "2", "state": "UNLOADING", "reason": ""},
        {"name": "embed", "version": "1", "state": "READY", "reason": ""},
        {"name": "embed", "version": "2", "state": "LOADING", "reason": ""},
    ]


def test_tritonclient_load_and_unload(
    triton: triton_http.InferenceServerClient, control: FakeControl
) -> None:
    triton.load_model("embed", headers=AUTH)
    triton.unload_model("embed", headers=AUTH)
    triton.unload_model("chat", headers=AUTH, unload_dependents=True)
    assert control.calls == [
        ("load", "embed", None),
        ("unload", "embed", None),
        ("unload", "chat", None),
    ]


def test_tritonclient_sees_errors(
    triton: triton_http.InferenceServerClient, control: FakeControl
) -> None:
    with pytest.raises(InferenceServerException) as missing:
        triton.load_model("missing", headers=AUTH)
    assert missing.value.status() == "404"
    assert missing.value.message() == "model 'missing' is not in the repository"
    with pytest.raises(InferenceServerException) as unauthorized:
        triton.load_model("embed")
    assert unauthorized.value.status() == "401"
    with pytest.raises(InferenceServerException) as traversal:
        triton.load_model("../../etc", headers=AUTH)
    assert traversal.value.status() in ("400", "404")  # the client may fold the dots first
    with pytest.raises(InferenceServerException) as override:
        triton.load_model("embed", headers=AUTH, config='{"backend": "onnx"}')
    assert override.value.status() == "400"
    assert control.calls == [("load", "missing", None)]
