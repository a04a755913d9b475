"""A newcomer's first command: bare `qiao serve` serves the built-in demo model, fast."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from test_demo_model import assert_english

from .conftest import SubprocessServer


def test_bare_qiao_serve_answers_chat_in_english(tmp_path: Path) -> None:
    # No flags at all: the port and the log interval come from the environment.
    env = {**os.environ, "QIAO_PORT": "0", "QIAO_LOG_INTERVAL": "0"}
    server = SubprocessServer(None, tmp_path / "server.log", env=env)
    try:
        server.wait_ready(timeout=60.0)  # a bound for a hung start, not a speed check
        with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
            models = [m["id"] for m in client.get("/v1/models").json()["data"]]
            # The generative model first: tools that take the first listed model get an LLM.
            assert models == ["demo_model", "all-MiniLM-L6-v2"]
            texts = []
            for seed in range(4):
                response = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "demo_model",
                        "messages": [{"role": "user", "content": "Good morrow! What news?"}],
                        "temperature": 0.8,
                        "seed": seed,
                        "max_tokens": 40,
                    },
                )
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["message"]["content"])
            # The built-in embedder: MiniLM's published vector for "hello world".
            response = client.post(
                "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hello world"}
            )
            assert response.status_code == 200, response.text
            head = response.json()["data"][0]["embedding"][:5]
            assert head == pytest.approx(
                [-0.034477, 0.031023, 0.006735, 0.026109, -0.039362], abs=1e-5
            )
        assert_english(" ".join(texts), min_words=10)
    finally:
        assert server.stop() == 0
