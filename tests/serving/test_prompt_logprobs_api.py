"""Scoring prompts the way lm-eval's `local-completions` does (`echo`, `logprobs`, `max_tokens:
0`) and vLLM's `prompt_logprobs`, through the official openai client against `qiao serve`
(engine in its own process), checked against Hugging Face transformers' log-softmax."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from .conftest import MODEL_NAME, SubprocessServer, openai_client

transformers = pytest.importorskip("transformers")

IDS = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395]  # "Once upon a time, ..."


@pytest.fixture(scope="module")
def client(qiao_server: SubprocessServer) -> Iterator[openai.OpenAI]:
    with openai_client(qiao_server.base_url) as c:
        yield c


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([IDS])).logits[0].float(), dim=-1)


def test_echo_scores_the_prompt_like_transformers(
    client: openai.OpenAI, reference: torch.Tensor
) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=IDS, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = response.choices[0]
    assert choice.text.strip().startswith("Once upon a time")
    assert response.usage is not None and response.usage.completion_tokens == 0
    assert choice.logprobs is not None
    token_logprobs = choice.logprobs.token_logprobs
    assert token_logprobs is not None and len(token_logprobs) == len(IDS)
    assert token_logprobs[0] is None
    expected = [reference[p - 1, IDS[p]].item() for p in range(1, len(IDS))]
    # The server runs the checkpoint's dtype (float32 here), as transformers does.
    assert token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(choice.logprobs.tokens or []).strip() == choice.text.strip()


def test_echo_with_a_completion_appends_it(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=IDS, max_tokens=5, temperature=0)
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=IDS, max_tokens=5, temperature=0, echo=True, logprobs=0
    )
    assert echoed.choices[0].text.endswith(plain.choices[0].text)
    assert echoed.choices[0].logprobs is not None
    assert len(echoed.choices[0].logprobs.token_logprobs or []) == len(IDS) + 5


def test_vllm_prompt_logprobs_in_completions_and_chat(
    client: openai.OpenAI, reference: torch.Tensor
) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=IDS, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    entries = response.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(IDS)
    for position in range(1, len(IDS)):
        entry = entries[position]
        assert entry[str(IDS[position])]["logprob"] == pytest.approx(
            reference[position - 1, IDS[position]].item(), abs=1e-4
        )
        top = reference[position - 1].topk(2).indices.tolist()
        assert {str(t) for t in top} <= set(entry)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "stream": True}, "echo"),
        ({"prompt_logprobs": 10_000}, "prompt_logprobs"),
    ],
)
def test_bad_scoring_requests_are_400(client: openai.OpenAI, extra: dict, field: str) -> None:
    body = {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/completions", body=body, cast_to=object)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == field
