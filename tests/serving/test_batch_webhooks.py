"""Batch end events as Standard Webhooks: a receiver in the test checks every delivery's
signature with the specification's own library (`standardwebhooks`); a receiver that fails
twice gets the third attempt, each attempt recorded on the batch; a target outside
--webhook-allowed-hosts is refused when the batch is created."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
from standardwebhooks.webhooks import Webhook

from .conftest import SubprocessServer, wait_until

SECRET = "whsec_" + base64.b64encode(b"qiao-webhook-test-secret-0123").decode()
LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "demo_model", "prompt": "Once", "max_tokens": 4},
        }
    )
    + "\n"
).encode()


class Receiver:
    """An HTTP server on 127.0.0.1 recording every POST; `/flaky` answers 500 twice first."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, str], bytes]] = []
        self.flaky_failures = 2
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append((self.path, dict(self.headers.items()), body))
                status = 200
                if self.path == "/flaky" and receiver.flaky_failures > 0:
                    receiver.flaky_failures -= 1
                    status = 500
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def on(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        return [(headers, body) for p, headers, body in self.received if p == path]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server(
    receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SubprocessServer]:
    folder = tmp_path_factory.mktemp("webhooks")
    args = [
        "--data-dir",
        str(folder / "data"),
        "--log-interval",
        "0",
        "--webhook-url",
        f"http://127.0.0.1:{receiver.port}/all",
        "--webhook-secret",
        SECRET,
        "--webhook-allowed-hosts",
        f"127.0.0.1:{receiver.port}",
        "--webhook-retry-base",
        "0.05",
    ]
    running = SubprocessServer(args, Path(folder / "server.log")).wait_ready()
    try:
        yield running
    finally:
        running.stop()


def _client(server: SubprocessServer) -> openai.OpenAI:
    """Not the recording client: these bodies echo the test's own receiver URL (127.0.0.1 and a
    port, which the recording client's leak check would flag)."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_signed_events_with_retries_recorded_on_the_batch(
    server: SubprocessServer, receiver: Receiver
) -> None:
    client = _client(server)
    upload = client.files.create(file=("one.jsonl", LINE), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"webhook_url": f"http://127.0.0.1:{receiver.port}/flaky"},
    )
    wait_until(lambda: len(receiver.on("/flaky")) == 3, 60, "three deliveries to /flaky")
    wait_until(lambda: len(receiver.on("/all")) == 1, 60, "the server-wide delivery")

    verifier = Webhook(SECRET)
    deliveries = receiver.on("/flaky") + receiver.on("/all")
    events = [verifier.verify(body, headers) for headers, body in deliveries]
    assert {e["type"] for e in events} == {"batch.completed"}
    assert {e["data"]["id"] for e in events} == {batch.id}
    assert len({headers["webhook-id"] for headers, _ in deliveries}) == 1  # one event, retried
    forged = dict(deliveries[0][0], **{"webhook-signature": "v1,AAAA"})
    with pytest.raises(Exception, match="signature"):
        verifier.verify(deliveries[0][1], forged)

    def recorded() -> list[dict[str, Any]]:
        return client.batches.retrieve(batch.id).model_extra["webhook_deliveries"]

    wait_until(lambda: len(recorded()) == 4, 30, "every attempt recorded on the batch")
    flaky = [d for d in recorded() if d["target"] == "metadata"]
    assert [(d["attempt"], d["status_code"], d["delivered"]) for d in flaky] == [
        (1, 500, False),
        (2, 500, False),
        (3, 200, True),
    ]
    assert {d["url"] for d in flaky} == {f"http://127.0.0.1:{receiver.port}/flaky"}
    # The server-wide target is the operator's: recorded, but its URL is not shown to users.
    (everyone,) = [d for d in recorded() if d["target"] == "server"]
    assert everyone["url"] is None and everyone["delivered"]
    assert client.batches.retrieve(batch.id).status == "completed"


def test_a_target_outside_the_allowed_hosts_is_refused(server: SubprocessServer) -> None:
    client = _client(server)
    upload = client.files.create(file=("one.jsonl", LINE), purpose="batch")
    for url in ("http://169.254.169.254/latest/meta-data", "ftp://127.0.0.1/x"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(
                input_file_id=upload.id,
                endpoint="/v1/completions",
                completion_window="24h",
                metadata={"webhook_url": url},
            )
        assert refused.value.body["param"] == "metadata"
        assert "webhook_url" in refused.value.body["message"]
