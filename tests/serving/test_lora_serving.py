"""Multi-LoRA through `qiao serve`: adapters from `--lora-modules` and the management API, picked
per request as `model: "base:adapter"` (or the adapter's bare name) through the official
`openai` client, each answer equal to PEFT's merged model's greedy continuation."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from .conftest import SubprocessServer, http_client, openai_client

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

BASE = "tiny"
TOKEN = "lora-management-token"
PROMPT = [1, 17, 42, 99, 5, 23, 61, 7, 150, 3, 88, 200]
MAX_TOKENS = 6
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "chat": dict(r=8, lora_alpha=8, target_modules=["k_proj", "gate_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (adapter folder, PEFT merged model's greedy text); None -> the base model's."""
    base_dir = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("served-adapters")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_dir)
    result = {}
    for seed, (name, config) in enumerate([(None, None), *ADAPTERS.items()]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        path = None
        if name is not None:
            peft_model = peft.get_peft_model(
                model, peft.LoraConfig(init_lora_weights=False, **config)
            )
            with torch.no_grad():
                for key, param in peft_model.named_parameters():
                    if "lora_" in key:
                        param.mul_(0.5)
            path = root / name
            peft_model.save_pretrained(path)
            model = peft.PeftModel.from_pretrained(
                transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                path,
            ).merge_and_unload()
        with torch.no_grad():
            out = model.eval().generate(
                torch.tensor([PROMPT]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
        text = tokenizer.decode(out[0, len(PROMPT) :], skip_special_tokens=True)
        result[name] = (path, text)
    assert len({text for _, text in result.values()}) == 3, "the adapters change nothing"
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, adapters, tmp_path_factory) -> Iterator[tuple[SubprocessServer, str]]:
    management_port = free_port()
    log_path = tmp_path_factory.mktemp("lora-server") / "server.log"
    args = [
        "--model",
        str(tiny_checkpoint("llama")),
        "--served-model-name",
        BASE,
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        "--log-interval",
        "0",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={adapters['sql'][0]}",
        "--management-port",
        str(management_port),
        "--management-token",
        TOKEN,
    ]
    process = SubprocessServer(args, log_path)
    try:
        yield process.wait_ready(), f"http://127.0.0.1:{management_port}"
    finally:
        process.stop()
    assert "Traceback" not in process.log(), process.log()[-3000:]


def _complete(client, model: str) -> str:
    completion = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return completion.choices[0].text


def test_adapter_per_request_equals_peft_merged(server, adapters):
    client = openai_client(server[0].base_url)
    assert _complete(client, f"{BASE}:sql") == adapters["sql"][1]
    assert _complete(client, "sql") == adapters["sql"][1]  # vLLM's bare adapter name
    assert _complete(client, BASE) == adapters[None][1]


def test_models_lists_adapters_with_their_parent(server):
    client = openai_client(server[0].base_url)
    cards = {card.id: card for card in client.models.list().data}
    assert cards["sql"].parent == BASE
    assert getattr(cards[BASE], "parent", None) is None
    assert client.models.retrieve(f"{BASE}:sql").parent == BASE


def test_unknown_adapter_is_404_naming_the_loaded_ones(server):
    client = openai_client(server[0].base_url)
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, f"{BASE}:nope")
    assert "nope" in info.value.message and "sql" in info.value.message


def test_management_load_and_unload(server, adapters):
    process, management_url = server
    base_url = process.base_url
    client = openai_client(base_url)
    body = {"lora_name": "chat", "lora_path": str(adapters["chat"][0])}
    with http_client(management_url) as management:
        refused = management.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 401
        headers = {"Authorization": f"Bearer {TOKEN}"}
        loaded = management.post("/v1/load_lora_adapter", json=body, headers=headers)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["adapters"] == ["chat", "sql"]
        assert _complete(client, f"{BASE}:chat") == adapters["chat"][1]
        bad = management.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "bad", "lora_path": str(adapters["chat"][0].parent / "missing")},
            headers=headers,
        )
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        gone = management.post(
            "/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=headers
        )
        assert gone.status_code == 200 and gone.json()["adapters"] == ["sql"]
        again = management.post(
            "/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=headers
        )
        assert again.status_code == 404
    with pytest.raises(openai.NotFoundError):
        _complete(client, f"{BASE}:chat")
    assert httpx.get(f"{base_url}/v1/models").json()["data"][-1]["id"] == "sql"


def test_batch_lines_name_adapters(server, adapters):
    """The Batch API takes the same model names: each line under its adapter."""
    import json

    from .conftest import wait_until

    client = openai_client(server[0].base_url)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {**body, "model": m}}
        for cid, m in (("a", f"{BASE}:sql"), ("b", BASE), ("c", f"{BASE}:nope"))
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    upload = client.files.create(file=("lora.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    done: list = []

    def finished() -> bool:
        done[:] = [client.batches.retrieve(batch.id)]
        return done[0].status in ("completed", "failed", "expired", "cancelled")

    wait_until(finished, 120.0, "the batch to finish", interval=0.1)
    assert done[0].status == "completed", done[0]
    answered = {
        r["custom_id"]: r
        for r in map(json.loads, client.files.content(done[0].output_file_id).text.splitlines())
    }
    assert answered["a"]["response"]["body"]["choices"][0]["text"] == adapters["sql"][1]
    assert answered["b"]["response"]["body"]["choices"][0]["text"] == adapters[None][1]
    errors = client.files.content(done[0].error_file_id).text
    assert "nope" in errors and "sql" in errors
