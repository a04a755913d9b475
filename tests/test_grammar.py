"""Structured output in the engine: the bitmask application, the compiled-grammar cache, and
constrained and free requests sharing steps (offline `LLM` on stories260K)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from qiao import LLM, SamplingParams
from qiao.errors import ConfigError
from qiao.runner.grammar import REFUSED_LOGIT, apply_token_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "pet": {"enum": ["dog", "cat"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "required": ["pet", "age"],
    "additionalProperties": False,
}


def test_apply_token_bitmask_matches_a_plain_loop() -> None:
    """Refused logits land at about -1e30 (float32: x + -1e30 rounds to -1e30)."""
    generator = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(4, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    original = logits.clone()
    expected = logits.clone()
    for j, row in enumerate((1, 3)):
        for token in range(vocab):
            if not (int(bitmask[j, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = REFUSED_LOGIT
    apply_token_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits, expected)
    every = original[[1, 3]].clone()  # all rows, in order
    apply_token_bitmask(every, bitmask)
    assert torch.equal(every, expected[[1, 3]])


@pytest.fixture(scope="module")
def llm(stories_dir: Path) -> LLM:
    return LLM(str(stories_dir), num_kv_blocks=128)


def test_constrained_and_free_requests_share_steps(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate(["Once upon a time"], free, use_tqdm=False)[0].outputs[0].text
    params = [
        free,
        SamplingParams(
            temperature=1.0, seed=5, n=3, max_tokens=60, structured_outputs={"json": SCHEMA}
        ),
        SamplingParams(
            temperature=1.0, seed=6, max_tokens=20, structured_outputs={"regex": "[a-c]{4}-[0-9]+"}
        ),
        SamplingParams(
            temperature=0.0, max_tokens=10, structured_outputs={"choice": ["Tom", "Sue"]}
        ),
    ]
    outputs = llm.generate(["Once upon a time"] * 4, params, use_tqdm=False)
    assert outputs[0].outputs[0].text == alone  # a free row is untouched by its neighbours' masks
    for sample in outputs[1].outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    regex_text = outputs[2].outputs[0].text
    assert re.fullmatch(r"[a-c]{4}-[0-9]+", regex_text), regex_text
    assert outputs[3].outputs[0].text in ("Tom", "Sue")


def test_compiled_grammars_are_reused(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, structured_outputs={"json": SCHEMA})
    llm.generate(["A"], params, use_tqdm=False)
    compiler = llm.engine._grammars
    assert compiler is not None
    cached = len(compiler._templates)
    llm.generate(["B", "C"], params, use_tqdm=False)
    assert len(compiler._templates) == cached


def test_a_bad_constraint_is_refused_before_it_runs(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ConfigError, match="structured_outputs"):
        llm.generate(["A"], SamplingParams(structured_outputs={"regex": "([a-"}), use_tqdm=False)
