"""Prompt logprobs (`SamplingParams.prompt_logprobs`) equal Hugging Face transformers'
log-softmax on the same weights (float32, 1e-4), whole or in prefill chunks, and a prefix-cache
hit never skips a position."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qiao import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338]
PROMPT += [401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328]
TOP = 3


@pytest.fixture(scope="module")
def reference(stories_dir: Path) -> torch.Tensor:
    """HF's log-softmax at every prompt position: row p scores token p + 1."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries: list, reference: torch.Tensor) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        expected = reference[position - 1]
        token = PROMPT[position]
        entry = entries[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=1e-4)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        top_values, top_ids = expected.topk(TOP)
        assert set(entry) == {token, *top_ids.tolist()}
        for tid, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert entry[tid].logprob == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_match_transformers(
    stories_dir: Path, reference: torch.Tensor, chunk: int | None
) -> None:
    extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(str(stories_dir), dtype="float32", num_kv_blocks=64, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0]
    check(output.prompt_logprobs, reference)
    assert output.prompt_logprobs[1][PROMPT[1]].decoded_token.strip() == "Once"


def test_a_prefix_cache_hit_skips_no_position(stories_dir: Path, reference: torch.Tensor) -> None:
    llm = LLM(str(stories_dir), dtype="float32", num_kv_blocks=64)
    warm = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([PROMPT], warm, use_tqdm=False)  # its blocks are now in the prefix cache
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert output.num_cached_tokens == 0
    check(output.prompt_logprobs, reference)
    # Without prompt logprobs the cache is used as before.
    assert llm.generate([PROMPT], warm, use_tqdm=False)[0].num_cached_tokens > 0


def test_n_samples_share_one_prompt_logprobs_list(stories_dir: Path) -> None:
    llm = LLM(str(stories_dir), num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=4, prompt_logprobs=0)
    output = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(output.outputs) == 3 and len(output.prompt_logprobs) == len(PROMPT)
    assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])  # the token alone
