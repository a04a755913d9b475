"""Speculative decoding behind `qiao serve`: the settings reach the engine, a greedy completion
read through the official `openai` client equals plain decoding's (offline `LLM`, no
speculation), and /metrics counts drafts under qiao's and vLLM's names."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from qiao import LLM, SamplingParams

from .conftest import InProcessServer, openai_client, parse_metrics

PROMPT = "Once upon a time there was a little fox. Once upon a time"


def test_serve_speculates_and_answers_as_plain_decoding(
    stories_dir: Path, make_inprocess_server: Callable[..., InProcessServer]
) -> None:
    server = make_inprocess_server(
        speculative_method="ngram", num_speculative_tokens=3, metrics_vllm_names=True
    )
    assert server.engine.engine.config.speculative is not None
    client = openai_client(server.base_url)
    answer = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=40, temperature=0
    )
    plain = LLM(str(stories_dir), max_num_seqs=4).generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False
    )
    assert answer.choices[0].text == plain[0].outputs[0].text
    metrics = parse_metrics(httpx.get(f"{server.base_url}/metrics").text)

    def total(name: str) -> float:
        return sum(v for (series, _), v in metrics.items() if series == name)

    drafts = total("qiao:spec_decode_num_drafts_total")
    assert drafts > 0
    assert total("vllm:spec_decode_num_drafts_total") == drafts
    assert (
        0
        < total("qiao:spec_decode_num_accepted_tokens_total")
        <= total("qiao:spec_decode_num_draft_tokens_total")
    )
