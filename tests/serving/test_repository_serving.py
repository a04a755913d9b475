"""`qiao serve --model-repository`: an LLM and an encoder side by side in one server.

The real `qiao serve` process, with KServe v2 over gRPC and the management listener on. Checked
with the official clients: `openai` for /v1, `tritonclient.http` and `tritonclient.grpc` for /v2;
MiniLM's embeddings against transformers' (through qiao's own test oracle, the published
"hello world" prefix).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from .conftest import GREEDY_32, PROMPT, SubprocessServer, parse_metrics

HELLO_WORLD_PREFIX = [-0.034477, 0.031023, 0.006735, 0.026109, -0.039362]
TOKEN = "management-token-for-tests"
SENTENCES = ["hello world", "The cat sat on the mat.", "qiao means bridge"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_repository(root: Path, stories_dir: Path, minilm_dir: Path) -> Path:
    (root / "stories" / "1").mkdir(parents=True)
    for item in stories_dir.iterdir():
        if item.is_file():
            shutil.copy(item, root / "stories" / "1" / item.name)
    (root / "stories" / "config.yaml").write_text(
        "backend: llm\nllm:\n  num_kv_blocks: 64\n  max_num_seqs: 8\n"
    )
    shutil.copytree(minilm_dir, root / "minilm" / "1")
    (root / "minilm" / "config.yaml").write_text(
        "backend: embedding\n"
        "max_batch_size: 32\n"
        "dynamic_batching:\n"
        "  preferred_batch_size: [4, 8]\n"
        "  max_queue_delay_microseconds: 200000\n"
    )
    return root


@pytest.fixture(scope="module")
def platform_server(
    stories_dir: Path, minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SubprocessServer, int, int]]:
    root = write_repository(tmp_path_factory.mktemp("repo"), stories_dir, minilm_dir)
    grpc_port, mgmt_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("platform-log") / "server.log"
    server = SubprocessServer(
        [
            "--model-repository",
            str(root),
            "--grpc-port",
            str(grpc_port),
            "--management-port",
            str(mgmt_port),
            "--management-token",
            TOKEN,
            "--log-interval",
            "0",
            "--drain-timeout",
            "2",
        ],
        log,
    )
    try:
        yield server.wait_ready(), grpc_port, mgmt_port
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def embed(client: httpx.Client, texts: list[str], model: str = "minilm") -> np.ndarray:
    response = client.post("/v1/embeddings", json={"model": model, "input": texts})
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert body["usage"]["prompt_tokens"] > 0
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def test_llm_and_encoder_side_by_side(platform_server: tuple[SubprocessServer, int, int]) -> None:
    import openai

    server, _, _ = platform_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    assert sorted(m.id for m in client.models.list().data) == ["minilm", "stories"]

    completion = client.completions.create(
        model="stories", prompt=PROMPT, max_tokens=32, temperature=0
    )
    assert completion.choices[0].text == GREEDY_32
    pinned = client.completions.create(
        model="stories@1", prompt=PROMPT, max_tokens=32, temperature=0
    )
    assert pinned.choices[0].text == GREEDY_32

    result = client.embeddings.create(model="minilm", input=SENTENCES)
    vectors = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(vectors[0, :5], HELLO_WORLD_PREFIX, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # base64 (the openai client's default on the wire) decodes to the same floats.
    with httpx.Client(base_url=server.base_url) as http:
        np.testing.assert_allclose(embed(http, SENTENCES), vectors, atol=1e-7)

        # Each model answers only its own kind of request, with a message saying where to go.
        wrong = http.post("/v1/embeddings", json={"model": "stories", "input": "hi"})
        assert wrong.status_code == 400 and "/v1/completions" in wrong.json()["error"]["message"]
        wrong = http.post(
            "/v1/completions", json={"model": "minilm", "prompt": "hi", "max_tokens": 2}
        )
        assert wrong.status_code == 400 and "/v1/embeddings" in wrong.json()["error"]["message"]
        missing = http.post("/v1/embeddings", json={"model": "minilm@7", "input": "hi"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        bad = http.post("/v1/embeddings", json={"model": "minilm@x", "input": "hi"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
        empty = http.post("/v1/embeddings", json={"model": "minilm", "input": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
        ids = http.post("/v1/embeddings", json={"model": "minilm", "input": [[101, 10**9, 102]]})
        assert ids.status_code == 400 and ids.json()["error"]["param"] == "input"
        assert "vocab" in ids.json()["error"]["message"]
        # Token ids in range embed like the text they spell.
        hello = http.post(
            "/v1/embeddings", json={"model": "minilm", "input": [[101, 7592, 2088, 102]]}
        )
        assert hello.status_code == 200
        head = hello.json()["data"][0]["embedding"][:5]
        np.testing.assert_allclose(head, HELLO_WORLD_PREFIX, atol=1e-5, rtol=0)
        dims = http.post(
            "/v1/embeddings", json={"model": "minilm", "input": "hi", "dimensions": 12}
        )
        assert dims.status_code == 400 and dims.json()["error"]["param"] == "dimensions"


def test_tritonclient_http_and_grpc_match_openai_embeddings(
    platform_server: tuple[SubprocessServer, int, int],
) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    server, grpc_port, _ = platform_server
    with httpx.Client(base_url=server.base_url) as http:
        expected = embed(http, SENTENCES)
    texts = np.array([s.encode() for s in SENTENCES], dtype=object)

    h = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        assert h.is_server_live() and h.is_server_ready() and h.is_model_ready("minilm")
        meta = h.get_model_metadata("minilm")
        assert meta["name"] == "minilm" and meta["versions"] == ["1"]
        assert meta["inputs"][0]["name"] == "text" and meta["inputs"][0]["datatype"] == "BYTES"
        assert meta["outputs"][0]["shape"] == [-1, 384]
        for binary in (True, False):
            inp = httpclient.InferInput("text", [len(SENTENCES)], "BYTES")
            inp.set_data_from_numpy(texts, binary_data=binary)
            out = httpclient.InferRequestedOutput("embedding", binary_data=binary)
            result = h.infer("minilm", [inp], outputs=[out], model_version="1")
            np.testing.assert_allclose(result.as_numpy("embedding"), expected, atol=1e-6)
    finally:
        h.close()

    g = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        assert g.is_server_live() and g.is_server_ready() and g.is_model_ready("minilm")
        meta = g.get_model_metadata("minilm", as_json=True)
        assert meta["name"] == "minilm" and meta["platform"] == "pytorch_libtorch"
        inp = grpcclient.InferInput("text", [len(SENTENCES)], "BYTES")
        inp.set_data_from_numpy(texts)
        result = g.infer("minilm", [inp])
        np.testing.assert_allclose(result.as_numpy("embedding"), expected, atol=1e-6)
        # The LLM through the same protocol: greedy text, as /v1/completions gives.
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object))
        budget = grpcclient.InferInput("max_tokens", [1], "INT32")
        budget.set_data_from_numpy(np.array([32], dtype=np.int32))
        text = g.infer("stories", [prompt, budget]).as_numpy("text_output")[0].decode()
        assert text == GREEDY_32
    finally:
        g.close()


def test_concurrent_requests_share_one_batch(
    platform_server: tuple[SubprocessServer, int, int],
) -> None:
    server, _, _ = platform_server
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        before = parse_metrics(http.get("/metrics").text)
        # 8 one-text requests at once reach the largest preferred size (8) within the delay.
        with ThreadPoolExecutor(8) as pool:
            rows = list(pool.map(lambda s: embed(http, [s]), [f"text {i}" for i in range(8)]))
        after = parse_metrics(http.get("/metrics").text)
        # Each request got its own row: the same as embedding the texts one batch at a time.
        together = embed(http, [f"text {i}" for i in range(8)])
    np.testing.assert_allclose(np.concatenate(rows), together, atol=1e-5)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("qiao:batch_size_count") == 1, "the 8 requests did not run as one batch"
    assert delta("qiao:batch_size_sum") == 8
    assert delta("qiao:infer_requests_total") == 8
    assert delta("qiao:batch_queue_time_seconds_count") == 8


def test_management_index_lists_every_version(
    platform_server: tuple[SubprocessServer, int, int],
) -> None:
    server, _, mgmt_port = platform_server
    base = f"http://127.0.0.1:{mgmt_port}"
    assert httpx.get(base + "/v1/repository").status_code == 401
    headers = {"Authorization": f"Bearer {TOKEN}"}
    index = httpx.get(base + "/v1/repository", headers=headers).json()["models"]
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("minilm", "1", "ready"),
        ("stories", "1", "ready"),
    }
    # Mode none: the repository is fixed at start; load says how to change that.
    answer = httpx.post(base + "/v1/repository/models/minilm/load", headers=headers)
    assert answer.status_code == 400 and "explicit" in answer.json()["error"]["message"]
    # The main listener does not serve the management API.
    assert httpx.get(server.base_url + "/v1/repository").status_code == 404


def test_onnx_backend_serves_what_the_pytorch_backend_serves(
    tiny_bert_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    from qiao.export.onnx import export_onnx

    checkpoint = tiny_bert_checkpoint("bert-mlm")
    root = tmp_path / "repo"
    shutil.copytree(checkpoint, root / "torch" / "1")
    (root / "torch" / "config.yaml").write_text("backend: embedding\n")
    export_onnx(checkpoint, root / "onnx" / "1")
    (root / "onnx" / "config.yaml").write_text(
        "backend: onnx\ndynamic_batching:\n  max_queue_delay_microseconds: 1000\n"
    )
    server = SubprocessServer(
        ["--model-repository", str(root), "--log-interval", "0"], tmp_path / "log"
    )
    try:
        server.wait_ready()
        texts = ["hello world", "a somewhat longer sentence to embed", "x"]
        with httpx.Client(base_url=server.base_url) as http:
            from_torch, from_onnx = embed(http, texts, "torch"), embed(http, texts, "onnx")
            meta = http.get("/v2/models/onnx").json()
        np.testing.assert_allclose(from_onnx, from_torch, atol=1e-4, rtol=0)
        assert meta["platform"] == "onnxruntime_onnx"
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_kserve_infer_on_the_llm_checks_its_inputs(
    platform_server: tuple[SubprocessServer, int, int],
) -> None:
    server, _, _ = platform_server

    def infer(max_tokens: int, text: str = PROMPT) -> httpx.Response:
        body = {
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]},
                {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [max_tokens]},
            ]
        }
        return httpx.post(server.base_url + "/v2/models/stories/infer", json=body, timeout=60)

    ok = infer(32)
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["data"] == [GREEDY_32]
    too_long = infer(100_000)
    assert too_long.status_code == 400 and "max_tokens" in too_long.json()["error"]
    assert infer(0).status_code == 400
    # Nothing was left running in the engine by the refused requests.
    assert infer(32).json()["outputs"][0]["data"] == [GREEDY_32]
