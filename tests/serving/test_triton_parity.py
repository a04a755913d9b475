"""Triton's model configuration, statistics and repository index on the main KServe listeners.

The real `qiao serve --model-repository` process (the stories LLM and MiniLM with dynamic
batching, as in test_repository_serving.py), checked with the official tritonclient.http and
tritonclient.grpc clients: what the config says matches the models, the statistics count the
requests sent here (HTTP, gRPC and OpenAI embeddings), and every `/v2` error is
`{"error": "..."}`. No assert depends on timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.utils import InferenceServerException

from .conftest import SubprocessServer
from .test_repository_serving import TOKEN, free_port, write_repository

MINILM_DIM = 384
EXPECTED_INDEX = [
    {"name": "minilm", "version": "1", "state": "READY", "reason": ""},
    {"name": "stories", "version": "1", "state": "READY", "reason": ""},
]


@pytest.fixture(scope="module")
def server(
    stories_dir: Path, minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SubprocessServer, int]]:
    root = write_repository(tmp_path_factory.mktemp("repo"), stories_dir, minilm_dir)
    grpc_port = free_port()
    log = tmp_path_factory.mktemp("parity-log") / "server.log"
    args = ["--model-repository", str(root), "--grpc-port", str(grpc_port)]
    args += ["--management-port", str(free_port()), "--management-token", TOKEN]
    process = SubprocessServer([*args, "--log-interval", "0", "--drain-timeout", "2"], log)
    try:
        yield process.wait_ready(), grpc_port
    finally:
        process.stop()
    assert "Traceback" not in process.log(), process.log()[-3000:]


@pytest.fixture
def http(server: tuple[SubprocessServer, int]) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server[0].port}")
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def grpc(server: tuple[SubprocessServer, int]) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server[1]}")
    try:
        yield client
    finally:
        client.close()


def _texts(*texts: str) -> np.ndarray:
    return np.array([t.encode() for t in texts], dtype=object)


def http_embed(client: httpclient.InferenceServerClient, *texts: str) -> None:
    text = httpclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(_texts(*texts))
    assert client.infer("minilm", [text]).as_numpy("embedding").shape == (len(texts), MINILM_DIM)


def grpc_embed(client: grpcclient.InferenceServerClient, *texts: str) -> None:
    text = grpcclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(_texts(*texts))
    assert client.infer("minilm", [text]).as_numpy("embedding").shape == (len(texts), MINILM_DIM)


# --- repository index ---------------------------------------------------------------------------


def test_repository_index_on_the_main_port(
    server: tuple[SubprocessServer, int],
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    # The management listener's rows: Triton's four keys and each version's circuit breaker.
    with_breakers = [{**row, "circuit_breaker": "closed"} for row in EXPECTED_INDEX]
    assert http.get_model_repository_index() == with_breakers
    models = grpc.get_model_repository_index(as_json=True)["models"]
    # protobuf's JSON leaves out empty strings (the reasons).
    assert [{"reason": "", **m} for m in models] == EXPECTED_INDEX
    ready_only = httpx.post(server[0].base_url + "/v2/repository/index", json={"ready": True})
    assert ready_only.status_code == 200 and ready_only.json() == with_breakers
    # Load and unload stay on the management listener.
    with pytest.raises(InferenceServerException):
        http.load_model("minilm")
    with pytest.raises(InferenceServerException) as unload:
        grpc.unload_model("minilm")
    assert unload.value.status() == "StatusCode.UNIMPLEMENTED"
    assert http.is_model_ready("minilm")


# --- model configuration ------------------------------------------------------------------------


def test_encoder_config(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    config = http.get_model_config("minilm")
    assert config == http.get_model_config("minilm", model_version="1")
    assert config == {
        "name": "minilm",
        "platform": "pytorch_libtorch",
        "backend": "embedding",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 32,
        # One text per row: Triton has no empty dims, so [1] reshaped to [] as Triton writes it.
        "input": [
            {
                "name": "text",
                "data_type": "TYPE_STRING",
                "dims": [1],
                "reshape": {"shape": []},
            }
        ],
        "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [MINILM_DIM]}],
        "dynamic_batching": {
            "preferred_batch_size": [4, 8],
            "max_queue_delay_microseconds": 200000,
        },
    }
    # The config is honest: [batch] + dims and [batch] + reshape are both accepted, and agree.
    embedded = []
    for key in ("dims", "reshape"):
        dims = config["input"][0][key] if key == "dims" else config["input"][0][key]["shape"]
        text = httpclient.InferInput("text", [2, *dims], "BYTES")
        text.set_data_from_numpy(_texts("a", "b").reshape(2, *dims))
        embedded.append(http.infer("minilm", [text]).as_numpy("embedding"))
    assert embedded[0].shape == (2, MINILM_DIM)
    np.testing.assert_array_equal(embedded[0], embedded[1])

    remote = grpc.get_model_config("minilm").config
    assert (remote.name, remote.platform, remote.backend) == (
        "minilm",
        "pytorch_libtorch",
        "embedding",
    )
    assert remote.max_batch_size == 32
    assert remote.version_policy.latest.num_versions == 1
    assert [(t.name, t.data_type, list(t.dims), list(t.reshape.shape)) for t in remote.input] == [
        ("text", triton_config.TYPE_STRING, [1], [])
    ]
    assert remote.input[0].HasField("reshape") and not remote.output[0].HasField("reshape")
    assert [(t.name, t.data_type, list(t.dims)) for t in remote.output] == [
        ("embedding", triton_config.TYPE_FP32, [MINILM_DIM])
    ]
    assert list(remote.dynamic_batching.preferred_batch_size) == [4, 8]
    assert remote.dynamic_batching.max_queue_delay_microseconds == 200000


def test_llm_config(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    config = http.get_model_config("stories")
    assert config == {
        "name": "stories",
        "platform": "qiao_llm",
        "backend": "llm",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": 0,  # continuous batching in the engine; no batch dimension
        "input": [
            {"name": "text_input", "data_type": "TYPE_STRING", "dims": [-1]},
            {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1]},
        ],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}],
    }
    remote = grpc.get_model_config("stories", model_version="1").config
    assert remote.max_batch_size == 0 and not remote.HasField("dynamic_batching")
    assert [(t.name, t.data_type, list(t.dims)) for t in remote.input] == [
        ("text_input", triton_config.TYPE_STRING, [-1]),
        ("max_tokens", triton_config.TYPE_INT32, [1]),
    ]


# --- statistics ---------------------------------------------------------------------------------


def _counts(stats: dict[str, Any]) -> dict[str, int]:
    """The counters of one model_stats entry (protobuf's JSON: strings, zeros left out)."""
    inference = stats.get("inference_stats", {})
    counts = {key: int(stats.get(key, 0)) for key in ("inference_count", "execution_count")}
    for key in ("success", "fail", "queue", "compute_infer"):
        counts[key] = int(inference.get(key, {}).get("count", 0))
        counts[f"{key}_ns"] = int(inference.get(key, {}).get("ns", 0))
    counts["last_inference"] = int(stats.get("last_inference", 0))
    counts["batches"] = sum(int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", []))
    return counts


def _only(stats: dict[str, Any]) -> dict[str, Any]:
    (entry,) = stats["model_stats"]
    return entry


def test_statistics_count_the_requests(
    server: tuple[SubprocessServer, int],
    http: httpclient.InferenceServerClient,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    before = _counts(_only(http.get_inference_statistics("minilm")))
    n = 3
    for i in range(n):
        http_embed(http, f"one text {i}")
    grpc_embed(grpc, "two", "texts")
    with httpx.Client(base_url=server[0].base_url) as client:
        embedded = client.post("/v1/embeddings", json={"model": "minilm", "input": ["x", "y"]})
        assert embedded.status_code == 200
        # A token sequence past MiniLM's 512 is refused: one failed request.
        refused = client.post("/v1/embeddings", json={"model": "minilm", "input": [[7] * 600]})
        assert refused.status_code == 400
    stats = _only(http.get_inference_statistics("minilm", model_version="1"))
    assert (stats["name"], stats["version"]) == ("minilm", "1")
    after = _counts(stats)
    requests = n + 2  # the 3 HTTP infers, the gRPC one, the OpenAI one
    assert after["inference_count"] - before["inference_count"] == n + 2 + 2  # rows
    assert after["success"] - before["success"] == requests
    assert after["fail"] - before["fail"] == 1
    assert after["queue"] - before["queue"] == requests
    assert after["compute_infer"] - before["compute_infer"] == requests
    executed = after["execution_count"] - before["execution_count"]
    assert 1 <= executed <= requests
    assert after["batches"] - before["batches"] == executed
    assert after["success_ns"] > before["success_ns"]
    assert after["compute_infer_ns"] > before["compute_infer_ns"]
    assert after["last_inference"] > 0

    # gRPC reports the same counters.
    remote = grpc.get_inference_statistics("minilm", as_json=True)["model_stats"]
    assert [_counts(entry) for entry in remote] == [after]


def test_statistics_of_the_llm_and_of_every_model(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    before = _counts(_only(grpc.get_inference_statistics("stories", as_json=True)))
    prompt = httpclient.InferInput("text_input", [2], "BYTES")
    prompt.set_data_from_numpy(_texts("Once upon a time", "The cat"))
    budget = httpclient.InferInput("max_tokens", [1], "INT32")
    budget.set_data_from_numpy(np.array([4], dtype=np.int32))
    assert http.infer("stories", [prompt, budget]).as_numpy("text_output").shape == (2,)
    bad = httpclient.InferInput("max_tokens", [1], "INT32")
    bad.set_data_from_numpy(np.array([0], dtype=np.int32))
    with pytest.raises(InferenceServerException, match="max_tokens"):
        http.infer("stories", [prompt, bad])
    after = _counts(_only(http.get_inference_statistics("stories")))
    assert after["inference_count"] - before["inference_count"] == 2
    assert after["success"] - before["success"] == 1
    assert after["fail"] - before["fail"] == 1
    assert after["execution_count"] - before["execution_count"] == 1

    every = http.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"]) for s in every] == [("minilm", "1"), ("stories", "1")]
    remote = grpc.get_inference_statistics(as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in remote] == [("minilm", "1"), ("stories", "1")]


def test_nv_inference_metrics_match_the_statistics(
    server: tuple[SubprocessServer, int], http: httpclient.InferenceServerClient
) -> None:
    http_embed(http, "counted once")
    stats = {(s["name"], s["version"]): s for s in http.get_inference_statistics()["model_stats"]}
    text = httpx.get(server[0].base_url + "/metrics").text
    metrics = {
        (family.name, sample.labels["model"], sample.labels["version"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("nv_inference_")
        for sample in family.samples
    }
    assert metrics[("nv_inference_count", "minilm", "1")] > 0
    for (model, version), entry in stats.items():
        inference = entry["inference_stats"]
        expected = {
            "nv_inference_count": entry["inference_count"],
            "nv_inference_exec_count": entry["execution_count"],
            "nv_inference_request_success": inference["success"]["count"],
            "nv_inference_request_failure": inference["fail"]["count"],
            "nv_inference_queue_duration_us": inference["queue"]["ns"] // 1000,
            "nv_inference_compute_infer_duration_us": inference["compute_infer"]["ns"] // 1000,
        }
        assert {name: metrics[(name, model, version)] for name in expected} == expected, model


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/models/nope/config", 404),
        ("GET", "/v2/models/nope/versions/1/config", 404),
        ("GET", "/v2/models/minilm/versions/9/config", 404),
        ("GET", "/v2/models/nope/stats", 404),
        ("GET", "/v2/models/minilm/versions/9/stats", 404),
        ("GET", "/v2/models/nope", 404),
        ("POST", "/v2/models/nope/infer", 404),
        ("GET", "/v2/no/such/route", 404),
        ("GET", "/v2/models/minilm/config/extra", 404),
        ("POST", "/v2/repository/models/minilm/load", 404),
        ("POST", "/v2/repository/models/minilm/unload", 404),
        ("GET", "/v2/repository/index", 405),
    ],
)
def test_v2_errors_are_kserve_shaped(
    server: tuple[SubprocessServer, int], method: str, path: str, status: int
) -> None:
    body = {} if method == "POST" else None
    response = httpx.request(method, server[0].base_url + path, json=body)
    assert response.status_code == status
    body = response.json()
    assert list(body) == ["error"] and isinstance(body["error"], str) and body["error"]


def test_bad_index_body_is_kserve_shaped(server: tuple[SubprocessServer, int]) -> None:
    response = httpx.post(server[0].base_url + "/v2/repository/index", json={"ready": "yes"})
    assert response.status_code == 400 and list(response.json()) == ["error"]


def test_unknown_model_through_the_clients(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    for call in (http.get_model_config, http.get_inference_statistics):
        with pytest.raises(InferenceServerException, match="nope"):
            call("nope")
    for call in (grpc.get_model_config, grpc.get_inference_statistics):
        with pytest.raises(InferenceServerException) as error:
            call("nope")
        assert error.value.status() == "StatusCode.NOT_FOUND"
