"""Detokenizing in the API process (`DeltaDetokenizer` over an engine that sends token ids) gives
what the engine's own detokenization gives: the same text, token ids, stop strings, finish reasons
and logprob token texts, although the engine learns of a stop string only some steps late."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from qiao.config import EngineConfig
from qiao.engine.llm_engine import LLMEngine
from qiao.engine.output_processor import DeltaDetokenizer
from qiao.outputs import RequestOutput
from qiao.sampling_params import SamplingParams

PROMPTS = [
    [1, 403, 407, 261, 378],  # <s> Once upon a time
    [1, 403, 407, 261, 378, 432, 383, 286, 261, 376],  # ... , there was a little
    [1, 458, 261],
]
CASES: dict[str, dict[str, Any]] = {
    "greedy stop": {"temperature": 0.0, "stop": ["Lily", " park"], "max_tokens": 60},
    "sampled n=3 with logprobs": {
        "temperature": 1.0,
        "seed": 7,
        "n": 3,
        "stop": [" the", "."],
        "logprobs": 2,
        "max_tokens": 40,
    },
    "stop kept in output": {
        "temperature": 0.8,
        "seed": 3,
        "stop": [","],
        "include_stop_str_in_output": True,
        "max_tokens": 40,
    },
    "no stop string": {"temperature": 0.0, "logprobs": 1, "max_tokens": 25},
    "multi-token stop": {"temperature": 0.0, "stop": ["little girl"], "max_tokens": 60},
}

# (text, token ids, finish_reason, stop_reason, logprob token texts, sampled logprobs)
Sample = tuple[str, list[int], str | None, Any, list[list[str | None]], list[float]]


def fold(results: dict[tuple[str, int], list[Any]], output: RequestOutput) -> None:
    for c in output.outputs:
        entry = results.setdefault((output.request_id, c.index), ["", [], None, None, [], [], None])
        entry[0] += c.text
        entry[1] += c.token_ids
        for token_id, lp in zip(c.token_ids, c.logprobs or [], strict=False):
            entry[4].append(sorted(str(p.decoded_token) for p in lp.values()))
            entry[5].append(round(lp[token_id].logprob, 4))
        if c.finish_reason is not None and entry[2] is None:
            entry[2], entry[3] = c.finish_reason, c.stop_reason
        entry[6] = c.cumulative_logprob


def run_engine_side(path: Path, params: SamplingParams) -> dict[tuple[str, int], list[Any]]:
    engine = LLMEngine(EngineConfig.create(str(path), device="cpu"))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params, stream=True)
    results: dict[tuple[str, int], list[Any]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            fold(results, output)
    return results


def run_api_side(path: Path, params: SamplingParams, lag: int) -> dict[tuple[str, int], list[Any]]:
    """As an engine process and its API process: the engine sends ids, the API side makes the
    text and tells the engine of stop strings `lag` steps later (frames in flight)."""
    engine = LLMEngine(EngineConfig.create(str(path), device="cpu"), detokenize=False)
    assert engine.tokenizer is None  # the checkpoint names its EOS ids: no tokenizer needed
    tokenizer = LLMEngine(EngineConfig.create(str(path), device="cpu")).tokenizer
    detokenizers = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params, stream=True)
        detokenizers[f"r{i}"] = DeltaDetokenizer(tokenizer, prompt, params)
    results: dict[tuple[str, int], list[Any]] = {}
    in_flight: dict[int, list[tuple[str, int]]] = defaultdict(list)
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step() + engine.stop_samples(in_flight.pop(steps, []))
        steps += 1
        for output in outputs:
            assert all(c.text == "" for c in output.outputs)
            detokenizer = detokenizers.get(output.request_id)
            if detokenizer is None:
                continue  # answered already: the engine's later outputs are dropped
            output, stopped = detokenizer.process(output)
            in_flight[steps + lag - 1] += [(output.request_id, index) for index in stopped]
            fold(results, output)
            if output.finished:
                del detokenizers[output.request_id]
    assert not detokenizers, "every request finished on the API side"
    return results


@pytest.mark.parametrize("lag", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_api_side_text_equals_engine_side(stories_dir: Path, case: str, lag: int) -> None:
    params = SamplingParams(**CASES[case])
    expected = run_engine_side(stories_dir, params)
    got = run_api_side(stories_dir, params, lag)
    assert set(got) == set(expected)
    for key, want in expected.items():
        have = got[key]
        assert have[:6] == want[:6], key
        if want[6] is not None:
            assert have[6] == pytest.approx(want[6], abs=1e-3), key
    if "stop" in CASES[case]:
        reasons = [v[2] for v in expected.values()]
        assert "stop" in reasons, "the case must exercise a stop string"


def test_engine_stops_a_sample_it_is_told_to(stories_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.create(str(stories_dir), device="cpu"), detokenize=False)
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=50, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], params, stream=True)
    engine.step()
    outputs = engine.stop_samples([("r", 1), ("gone", 0)])
    assert [c.finish_reason for c in outputs[0].outputs] == [None, "stop"]
    assert engine.scheduler.num_running == 1
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[-1].finished
