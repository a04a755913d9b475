"""The response cache on a real `qiao serve` (issue 24): what is a hit, what never is, scope
per API key, streams from the cache read by the official openai client, embeddings and KServe
hits, the bounds under distinct requests, TTL expiry, a reload making the next request a miss
(a per-model `response_cache:` turning it on), and Redis shared by two servers."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from .conftest import SubprocessServer, openai_client, wait_until
from .test_lora_serving import MAX_TOKENS as LORA_MAX_TOKENS
from .test_lora_serving import PROMPT as LORA_PROMPT
from .test_lora_serving import TOKEN as LORA_TOKEN
from .test_lora_serving import adapters  # noqa: F401  (the fixture: PEFT adapters and texts)
from .test_repository_serving import TOKEN, free_port

KEY_A = "response-cache-key-a-0123456789"
KEY_B = "response-cache-key-b-0123456789"
LLM = "demo_model"
EMBEDDER = "all-MiniLM-L6-v2"
GREEDY = {"model": LLM, "prompt": "To be, or not", "max_tokens": 8, "temperature": 0}
CHAT = {
    "model": LLM,
    "messages": [{"role": "user", "content": "Good morrow!"}],
    "max_tokens": 8,
    "temperature": 0,
}


GRPC_PORT = free_port()


def cache_series(metrics: str, name: str, model: str = LLM) -> float:
    match = re.search(rf'^qiao:response_cache_{name}{{model_name="{model}"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    """The built-in demo models (an LLM and MiniLM) with the cache on and two API keys."""
    log = tmp_path_factory.mktemp("response-cache") / "server.log"
    args = ["--response-cache", "--api-key", KEY_A, "--api-key", KEY_B, "--log-interval", "0"]
    server = SubprocessServer([*args, "--grpc-port", str(GRPC_PORT)], log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def client(server: SubprocessServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60.0) as c:
        yield c


def test_repeated_greedy_request_is_a_hit_with_the_identical_body(
    server: SubprocessServer, client: httpx.Client
) -> None:
    for route, body in (("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)):
        first = client.post(route, json=body)
        again = client.post(route, json=body)
        assert first.status_code == again.status_code == 200, first.text
        assert first.headers["x-qiao-cache"] == "miss"
        assert again.headers["x-qiao-cache"] == "hit"
        assert again.content == first.content  # id and created included
    # Through the official client, the same: omitted fields default as they are spelt out.
    openai = openai_client(server.base_url, KEY_A)
    raw = openai.completions.with_raw_response.create(**{**GREEDY, "n": 1, "echo": False})
    assert raw.headers["x-qiao-cache"] == "hit"
    assert (
        raw.parse().choices[0].text
        == client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    )


def test_seeded_sampling_is_cached_unseeded_sampling_never(client: httpx.Client) -> None:
    sampled = {**GREEDY, "prompt": "Friends, Romans", "temperature": 0.9}
    for _ in range(3):
        response = client.post("/v1/completions", json=sampled)
        assert response.status_code == 200 and response.headers["x-qiao-cache"] == "skip"
    seeded = {**sampled, "seed": 42}
    assert client.post("/v1/completions", json=seeded).headers["x-qiao-cache"] == "miss"
    assert client.post("/v1/completions", json=seeded).headers["x-qiao-cache"] == "hit"


def test_cache_false_neither_reads_nor_writes(
    server: SubprocessServer, client: httpx.Client
) -> None:
    body = {**GREEDY, "prompt": "Now is the winter"}
    openai = openai_client(server.base_url, KEY_A)
    raw = openai.completions.with_raw_response.create(**body, extra_body={"cache": False})
    assert raw.headers["x-qiao-cache"] == "skip"
    assert client.post("/v1/completions", json=body).headers["x-qiao-cache"] == "miss"
    assert (
        client.post("/v1/completions", json={**body, "cache": False}).headers["x-qiao-cache"]
        == "skip"
    )
    refused = client.post("/v1/completions", json={**body, "cache": "no"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache"


def test_two_api_keys_do_not_share_entries(server: SubprocessServer) -> None:
    body = {**GREEDY, "prompt": "A horse, a horse"}
    for key in (KEY_A, KEY_B):
        with httpx.Client(
            base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60.0
        ) as c:
            assert c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "miss"
            assert c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "hit"


def test_stream_is_served_from_the_cache_and_reads_the_same_text(
    server: SubprocessServer, client: httpx.Client
) -> None:
    openai = openai_client(server.base_url, KEY_A)
    for kind, body in (("completion", {**GREEDY, "prompt": "O Romeo"}), ("chat", CHAT)):
        route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
        whole = client.post(route, json=body).json()
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", route, json=streamed) as response:
            assert response.headers["x-qiao-cache"] == "hit"
            assert response.headers["content-type"].startswith("text/event-stream")
            response.read()
        parts, usage = [], None
        if kind == "completion":
            for chunk in openai.completions.create(**streamed):
                parts += [c.text for c in chunk.choices]
                usage = chunk.usage or usage
            text = whole["choices"][0]["text"]
        else:
            for chunk in openai.chat.completions.create(**streamed):
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            text = whole["choices"][0]["message"]["content"]
        assert "".join(parts) == text
        assert usage is not None and usage.completion_tokens == whole["usage"]["completion_tokens"]


def test_embeddings_and_kserve_infers_are_hits(client: httpx.Client) -> None:
    body = {"model": EMBEDDER, "input": ["hello world", "the cat sat"]}
    first, again = (client.post("/v1/embeddings", json=body) for _ in range(2))
    assert first.headers["x-qiao-cache"] == "miss" and again.headers["x-qiao-cache"] == "hit"
    assert again.content == first.content
    infer = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]}]}
    route = f"/v2/models/{EMBEDDER}/infer"
    first, again = (client.post(route, json=infer) for _ in range(2))
    assert first.status_code == 200, first.text
    assert first.headers["x-qiao-cache"] == "miss" and again.headers["x-qiao-cache"] == "hit"
    assert again.content == first.content
    binary = {**infer, "parameters": {"binary_data_output": True}}
    first, again = (client.post(route, json=binary) for _ in range(2))
    assert again.headers["x-qiao-cache"] == "hit" and again.content == first.content
    assert (
        again.headers["inference-header-content-length"]
        == first.headers["inference-header-content-length"]
    )
    skipped = client.post(route, json={**infer, "parameters": {"cache": False}})
    assert skipped.headers["x-qiao-cache"] == "skip"


def test_kserve_grpc_infers_are_hits_per_key(server: SubprocessServer) -> None:
    from qiao.api.proto import inference_pb2 as pb
    from qiao.api.proto import inference_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name=EMBEDDER)
    request.inputs.add(
        name="text",
        datatype="BYTES",
        shape=[1, 1],
        contents=pb.InferTensorContents(bytes_contents=[b"over gRPC"]),
    )
    scheduled = pb.ModelInferRequest()
    scheduled.CopyFrom(request)
    scheduled.parameters["priority"].int64_param = 1  # scheduling only: the same entry
    skipped = pb.ModelInferRequest()
    skipped.CopyFrom(request)
    skipped.parameters["cache"].bool_param = False
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def infer(message: Any, key: str = KEY_A) -> tuple[Any, str]:
            reply, call = stub.ModelInfer.with_call(
                message, metadata=[("authorization", f"Bearer {key}")], timeout=60
            )
            return reply, dict(call.initial_metadata())["x-qiao-cache"]

        first, status = infer(request)
        assert status == "miss"
        again, status = infer(scheduled)
        assert status == "hit" and again == first
        assert infer(request, KEY_B)[1] == "miss"
        assert infer(skipped)[1] == "skip"


def test_hits_and_misses_are_counted(client: httpx.Client) -> None:
    before = client.get("/metrics").text
    body = {**GREEDY, "prompt": "All the world"}
    client.post("/v1/completions", json=body)
    client.post("/v1/completions", json=body)
    after = client.get("/metrics").text
    assert cache_series(after, "hits_total") == cache_series(before, "hits_total") + 1
    assert cache_series(after, "misses_total") == cache_series(before, "misses_total") + 1
    assert cache_series(after, "entries") >= 1 and cache_series(after, "bytes") > 0


# --- bounds and TTL ------------------------------------------------------------------------

MAX_ENTRIES, MAX_BYTES = 4, 3000


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    log = tmp_path_factory.mktemp("response-cache-bounded") / "server.log"
    args = [
        "--response-cache",
        "--response-cache-max-entries",
        str(MAX_ENTRIES),
        "--response-cache-max-bytes",
        str(MAX_BYTES),
        "--response-cache-ttl",
        "3",
        "--log-interval",
        "0",
    ]
    server = SubprocessServer(args, log)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_bounds_hold_under_a_stream_of_distinct_requests(bounded: SubprocessServer) -> None:
    with httpx.Client(base_url=bounded.base_url, timeout=60.0) as c:
        for i in range(12):
            body = {**GREEDY, "prompt": f"Line {i} of the play", "max_tokens": 4}
            assert c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "miss"
            metrics = c.get("/metrics").text
            assert cache_series(metrics, "entries") <= MAX_ENTRIES
            assert cache_series(metrics, "bytes") <= MAX_BYTES
        metrics = c.get("/metrics").text
        held = cache_series(metrics, "entries")
        # Every miss was stored; each one no longer held was evicted (an entry past its TTL
        # leaves only when looked up or evicted, and none of these was looked up again).
        assert 1 <= held <= MAX_ENTRIES
        assert cache_series(metrics, "evictions_total") == 12 - held


def test_entries_expire_after_the_ttl(bounded: SubprocessServer) -> None:
    body = {**GREEDY, "prompt": "Tomorrow, and tomorrow", "max_tokens": 4}
    with httpx.Client(base_url=bounded.base_url, timeout=60.0) as c:
        assert c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "miss"
        assert c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "hit"
        wait_until(
            lambda: c.post("/v1/completions", json=body).headers["x-qiao-cache"] == "miss",
            30.0,
            "the entry to expire after its 3 s TTL",
            interval=0.2,
        )


# --- a repository: reload, per-model config ----------------------------------------------------


def embed(base_url: str, text: str = "hello world") -> httpx.Response:
    return httpx.post(
        base_url + "/v1/embeddings", json={"model": "embed", "input": text}, timeout=60.0
    )


@pytest.fixture
def repo(tmp_path: Path, tiny_bert_checkpoint: Callable[[str], Path]) -> Path:
    root = tmp_path / "repo"
    (root / "embed").mkdir(parents=True)
    # The server's flag stays off: this model's config turns the cache on for it.
    (root / "embed" / "config.yaml").write_text(
        "backend: embedding\nresponse_cache: {enabled: true, ttl: 300}\n"
    )
    shutil.copytree(tiny_bert_checkpoint("bert-model"), root / "embed" / "1")
    return root


def test_a_reload_makes_the_next_request_a_miss(
    repo: Path, tmp_path: Path, tiny_bert_checkpoint: Callable[[str], Path]
) -> None:
    mgmt_port = free_port()
    args = ["--model-repository", str(repo), "--model-control-mode", "explicit"]
    args += ["--load-model", "embed", "--management-port", str(mgmt_port)]
    args += ["--management-token", TOKEN, "--log-interval", "0", "--drain-timeout", "2"]
    server = SubprocessServer(args, tmp_path / "server.log").wait_ready()
    try:
        first, again = embed(server.base_url), embed(server.base_url)
        assert first.headers["x-qiao-cache"] == "miss" and again.headers["x-qiao-cache"] == "hit"
        # New files in version 1, then a reload: the next answer comes from the new weights.
        shutil.rmtree(repo / "embed" / "1")
        shutil.copytree(tiny_bert_checkpoint("bert-mlm"), repo / "embed" / "1")
        reload = httpx.post(
            f"http://127.0.0.1:{mgmt_port}/v1/repository/models/embed/reload",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60.0,
        )
        assert reload.status_code == 200, reload.text
        after = embed(server.base_url)
        assert after.headers["x-qiao-cache"] == "miss"
        assert after.json()["data"][0]["embedding"] != first.json()["data"][0]["embedding"]
        assert embed(server.base_url).headers["x-qiao-cache"] == "hit"
    finally:
        server.stop()


# --- Redis, shared by two servers -------------------------------------------------------------


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (./dev setup installs it as root with apt-get)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        redis = pytest.importorskip("redis")
        client = redis.Redis(host="127.0.0.1", port=port)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_until(up, 20.0, "redis-server to answer PING", interval=0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_backend_is_shared_by_two_servers(
    redis_url: str, repo: Path, tmp_path: Path, tiny_bert_checkpoint: Callable[[str], Path]
) -> None:
    args = ["--model-repository", str(repo), "--response-cache-backend", redis_url]
    args += ["--model-control-mode", "explicit", "--load-model", "embed"]
    args += ["--log-interval", "0", "--drain-timeout", "2"]
    mgmt_port = free_port()
    one = SubprocessServer(
        [*args, "--management-port", str(mgmt_port), "--management-token", TOKEN],
        tmp_path / "one.log",
    )
    two = SubprocessServer(args, tmp_path / "two.log")
    try:
        one.wait_ready()
        two.wait_ready()
        filled = embed(one.base_url, "shared between replicas")
        assert filled.headers["x-qiao-cache"] == "miss"
        served = embed(two.base_url, "shared between replicas")
        assert served.headers["x-qiao-cache"] == "hit"
        assert served.content == filled.content
        assert embed(two.base_url, "only here").headers["x-qiao-cache"] == "miss"
        # A reload on one replica drops the version's entries for every replica.
        shutil.rmtree(repo / "embed" / "1")
        shutil.copytree(tiny_bert_checkpoint("bert-mlm"), repo / "embed" / "1")
        reload = httpx.post(
            f"http://127.0.0.1:{mgmt_port}/v1/repository/models/embed/reload",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60.0,
        )
        assert reload.status_code == 200, reload.text
        wait_until(
            lambda: embed(two.base_url, "only here").headers["x-qiao-cache"] == "miss",
            10.0,
            "the reload on one server to drop the shared entries",
            interval=0.1,
        )
        renewed = embed(one.base_url, "shared between replicas")
        assert renewed.headers["x-qiao-cache"] == "miss" and renewed.content != filled.content
    finally:
        one.stop()
        two.stop()


def test_a_canary_split_never_answers_from_the_other_versions_entry(
    tmp_path: Path, tiny_bert_checkpoint: Callable[[str], Path]
) -> None:
    root = tmp_path / "repo"
    (root / "embed").mkdir(parents=True)
    (root / "embed" / "config.yaml").write_text(
        "backend: embedding\nversion_policy: all\ntraffic: {1: 50, 2: 50}\n"
    )
    shutil.copytree(tiny_bert_checkpoint("bert-model"), root / "embed" / "1")
    shutil.copytree(tiny_bert_checkpoint("bert-mlm"), root / "embed" / "2")
    args = ["--model-repository", str(root), "--response-cache", "--log-interval", "0"]
    server = SubprocessServer(args, tmp_path / "server.log").wait_ready()
    try:
        # Round-robin over the two versions: each version's first answer is a miss, its second
        # a hit with its own answer, never the other version's.
        answers = [embed(server.base_url) for _ in range(4)]
        statuses = [a.headers["x-qiao-cache"] for a in answers]
        assert statuses == ["miss", "miss", "hit", "hit"]
        first, second, third, fourth = (a.content for a in answers)
        assert first != second
        assert {third, fourth} == {first, second}
        pinned = httpx.post(
            server.base_url + "/v1/embeddings",
            json={"model": "embed@1", "input": "hello world"},
            timeout=60.0,
        )
        assert pinned.headers["x-qiao-cache"] == "miss"  # the body names embed@1: its own key
    finally:
        server.stop()


# --- LoRA adapters ------------------------------------------------------------------------------


def test_an_adapter_loaded_again_under_its_name_is_a_miss(
    tiny_checkpoint: Callable[[str], Path],
    adapters: dict,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    mgmt_port = free_port()
    args = ["--model", str(tiny_checkpoint("llama")), "--served-model-name", "tiny"]
    args += ["--device", "cpu", "--num-kv-blocks", "64", "--log-interval", "0"]
    args += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    args += ["--lora-modules", f"x={adapters['sql'][0]}", "--response-cache"]
    args += ["--management-port", str(mgmt_port), "--management-token", LORA_TOKEN]
    server = SubprocessServer(args, tmp_path / "server.log").wait_ready()
    body = {"model": "tiny:x", "prompt": LORA_PROMPT, "max_tokens": LORA_MAX_TOKENS}
    body |= {"temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {LORA_TOKEN}"}
    management = f"http://127.0.0.1:{mgmt_port}"
    try:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as c:
            first, again = (c.post("/v1/completions", json=body) for _ in range(2))
            assert first.headers["x-qiao-cache"] == "miss", first.text
            assert again.headers["x-qiao-cache"] == "hit"
            assert first.json()["choices"][0]["text"] == adapters["sql"][1]
            gone = httpx.post(
                management + "/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=headers
            )
            assert gone.status_code == 200, gone.text
            loaded = httpx.post(
                management + "/v1/load_lora_adapter",
                json={"lora_name": "x", "lora_path": str(adapters["chat"][0])},
                headers=headers,
            )
            assert loaded.status_code == 200, loaded.text
            after = c.post("/v1/completions", json=body)
            assert after.headers["x-qiao-cache"] == "miss"
            assert after.json()["choices"][0]["text"] == adapters["chat"][1]
    finally:
        server.stop()
