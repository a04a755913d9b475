"""Security defaults: loopback bind, API keys on every route but the probes, the public-bind
refusal, CORS only when configured, and the key kept out of the log."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qiao.api.app import create_app
from qiao.api.middleware import bearer_matches
from qiao.api.server import build_engine
from qiao.api.settings import ServeSettings, load_settings
from qiao.errors import ConfigError

from .conftest import (
    MODEL_NAME,
    PROMPT,
    STARTUP_TIMEOUT_S,
    SubprocessServer,
    async_http_client,
    http_client,
    qiao_command,
    serve_settings,
)

API_KEY = "sk-qiao-test-7f3a9c1e"
PUBLIC_PATHS = {
    "/health",
    "/ping",
    "/health/live",
    "/health/ready",
    "/v2/health/live",
    "/v2/health/ready",
}
ORIGIN = "https://ui.example.com"


@pytest.fixture(scope="module")
def engine(stories_dir: Path) -> Any:
    """One engine (never started) shared by the apps built here; routes needing it are not run."""
    return build_engine(serve_settings(stories_dir, num_kv_blocks=16))


def _app(stories_dir: Path, engine: Any, **overrides: Any) -> Any:
    return create_app(serve_settings(stories_dir, **overrides), engine)


def _flat_routes(routes: Iterable[Any]) -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of every route, looking inside included routers."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is not None:  # FastAPI's lazily included router
            for context in contexts():
                yield context.path, set(context.methods or ())
        elif getattr(route, "path", None) is None and hasattr(route, "routes"):
            yield from _flat_routes(route.routes)
        else:
            yield route.path, set(getattr(route, "methods", None) or ())


def _asgi_send(app: Any, requests: list[tuple[str, str, dict]]) -> list[httpx.Response]:
    """Send (method, path, headers) requests straight to the ASGI app (no lifespan, no engine)."""

    async def send_all() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with async_http_client("http://testserver", transport=transport) as client:
            return [
                await client.request(method, path, headers=headers)
                for method, path, headers in requests
            ]

    return asyncio.run(send_all())


# --- bind ---------------------------------------------------------------------------------------


def test_default_bind_is_loopback() -> None:
    assert ServeSettings.model_fields["host"].default == "127.0.0.1"
    settings = load_settings([])
    assert settings.is_loopback_bind()
    settings.check_security()


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc shows them) listening on `port`."""
    addresses = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                addresses.append(address)
    return addresses


@pytest.fixture(scope="module")
def keyed_server(
    stories_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    """`qiao serve --api-key K` with the default host, logging at debug."""
    log_path = tmp_path_factory.mktemp("keyed") / "server.log"
    args = ["--model", str(stories_dir), "--api-key", API_KEY, "--log-interval", "0"]
    server = SubprocessServer([*args, "--log-level", "debug", "--drain-timeout", "1"], log_path)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_server_listens_on_loopback_only(keyed_server: SubprocessServer) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to list listening sockets")
    # 0100007F is 127.0.0.1 in /proc's little-endian hex.
    assert _listening_addresses(keyed_server.port) == ["0100007F"]


def test_api_key_guards_the_api_and_never_reaches_the_log(
    keyed_server: SubprocessServer,
) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    with http_client(keyed_server.base_url, timeout=30.0) as client:
        assert client.get("/health/live").status_code == 200
        assert client.get("/health/ready").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
            assert response.headers["WWW-Authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert client.post("/v1/completions", json=body, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        # A body that echoes the key back must not be logged either.
        client.post("/v1/completions", json={**body, "model": API_KEY}, headers=good)
    assert keyed_server.log(), "the server wrote no log at all"
    assert API_KEY not in keyed_server.log()


def test_every_route_but_the_probes_needs_the_key(stories_dir: Path, engine: Any) -> None:
    app = _app(stories_dir, engine, api_key=[API_KEY])
    routes = sorted(
        (path, method) for path, methods in _flat_routes(app.routes) for method in methods
    )
    paths = {path for path, _ in routes}
    # The enumeration really found the API (an empty list would pass everything below).
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics"} <= paths
    assert paths >= PUBLIC_PATHS

    anonymous = _asgi_send(app, [(method, path, {}) for path, method in routes])
    for (path, method), response in zip(routes, anonymous, strict=True):
        if path in PUBLIC_PATHS:
            assert response.status_code != 401, (method, path)
        else:
            assert response.status_code == 401, (method, path)

    gets = [(path, method) for path, method in routes if method == "GET"]
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    with_key = _asgi_send(app, [(method, path, keyed) for path, method in gets])
    for (path, method), response in zip(gets, with_key, strict=True):
        assert response.status_code != 401, (method, path)


def test_public_bind_without_key_refuses_to_start(stories_dir: Path) -> None:
    result = subprocess.run(
        [*qiao_command(), "serve", "--model", str(stories_dir), "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "0.0.0.0" in output and "--api-key" in output
    assert "--allow-insecure-public-bind" in output
    assert "Traceback" not in output
    assert "Uvicorn running" not in output


def test_public_bind_check_passes_with_a_key_or_explicit_consent(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_settings(["--host", "0.0.0.0"]).check_security()
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_settings(["--host", "192.168.1.10"]).check_security()
    load_settings(["--host", "0.0.0.0", "--allow-insecure-public-bind"]).check_security()
    load_settings(["--host", "0.0.0.0", "--api-key", API_KEY]).check_security()
    key_file = tmp_path / "keys"
    key_file.write_text(f"# keys\n{API_KEY}\n")
    load_settings(["--host", "0.0.0.0", "--api-key-file", str(key_file)]).check_security()
    for loopback in ("127.0.0.1", "localhost", "::1", "127.0.0.5"):
        load_settings(["--host", loopback]).check_security()


@pytest.mark.parametrize(
    ("config_text", "complaint"),
    [
        ('api_key: [""]\n', "got an empty one"),
        ("api_key: [short-key]\n", "got one of 9"),
        ('api_key: ["sk-long-enough-but has a space"]\n', "without spaces"),
    ],
)
def test_empty_short_and_unsendable_keys_refuse_to_start(
    tmp_path: Path, config_text: str, complaint: str
) -> None:
    config = tmp_path / "qiao.yaml"
    config.write_text("host: 0.0.0.0\n" + config_text)
    with pytest.raises(ConfigError, match=r"at least 16 characters|printable ASCII") as caught:
        load_settings(["--config", str(config)]).check_security()
    assert complaint in str(caught.value)
    assert "short-key" not in str(caught.value)  # the secret itself is never repeated
    key_file = tmp_path / "keys"
    key_file.write_text(f"{API_KEY}\nshort\n")
    with pytest.raises(ConfigError, match=r"api_key_file \(key 2\).*got one of 5"):
        load_settings(["--api-key-file", str(key_file)]).check_security()


def test_an_empty_bearer_token_never_authenticates() -> None:
    for header in (b"Bearer", b"Bearer ", b"Bearer    ", b"bearer \t"):
        assert not bearer_matches(header, [b""])
        assert not bearer_matches(header, [API_KEY.encode()])
    assert bearer_matches(f"Bearer {API_KEY}".encode(), [b"", API_KEY.encode()])


def _cors_requests() -> list[tuple[str, str, dict]]:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    return [("OPTIONS", "/v1/completions", preflight), ("GET", "/v1/models", {"Origin": ORIGIN})]


def test_cors_is_off_by_default(stories_dir: Path, engine: Any) -> None:
    for response in _asgi_send(_app(stories_dir, engine), _cors_requests()):
        assert "access-control-allow-origin" not in response.headers


def test_cors_allows_only_the_configured_origin(stories_dir: Path, engine: Any) -> None:
    app = _app(stories_dir, engine, cors_origins=[ORIGIN], api_key=[API_KEY])
    preflight, simple = _asgi_send(app, _cors_requests())
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    # The simple request has no key: refused, whatever the origin.
    assert simple.status_code == 401
    other = {"Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"}
    (refused,) = _asgi_send(app, [("OPTIONS", "/v1/completions", other)])
    assert refused.headers.get("access-control-allow-origin") != "https://evil.example.com"
