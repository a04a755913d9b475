"""Tensor parallelism (`tensor_parallel_size`): the same checkpoint split over 2 gloo ranks (the
engine's runner and one worker process it drives) gives exactly the greedy tokens of one rank,
on the real stories260K and on a random Llama-shaped model with grouped-query attention, biases
and a vocabulary that does not divide evenly; prompt logprobs agree; no worker outlives it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qiao.distributed import parallel_state
from qiao.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
STORIES_DIR = REPO.parent / "shared" / "models" / "stories260K-hf"

_GENERATE = """
import json, sys
from qiao import LLM, SamplingParams
size, model, prompts = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
llm = LLM(
    model,
    dtype="float32",
    max_model_len=96,
    profile=None,
    num_threads=1,
    tensor_parallel_size=size,
    skip_tokenizer_init=isinstance(prompts[0], dict),
)
params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1)
outputs = llm.generate(prompts, params, use_tqdm=False)
runner = llm.engine.runner
print(json.dumps({
    "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    "prompt_logprobs": [
        [None if p is None else max(v.logprob for v in p.values()) for p in o.prompt_logprobs]
        for o in outputs
    ],
    "workers": [] if runner.tp is None else runner.tp.pids,
}))
"""


def _greedy(model: Path, prompts: list, size: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _GENERATE, str(size), str(model), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["workers"]) == size - 1
    for pid in result["workers"]:  # stopped when the engine's process ended
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"worker {pid} outlived it"
    return result


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _same(one: dict, two: dict) -> None:
    assert two["tokens"] == one["tokens"]
    for a, b in zip(one["prompt_logprobs"], two["prompt_logprobs"], strict=True):
        assert (a[0], b[0]) == (None, None)
        assert b[1:] == pytest.approx(a[1:], abs=1e-4)


def test_tp2_gives_the_greedy_tokens_of_tp1_on_stories260k() -> None:
    if not (STORIES_DIR / "config.json").is_file():
        pytest.skip(f"real weights not present: {STORIES_DIR}")
    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
    one, two = _greedy(STORIES_DIR, prompts, 1), _greedy(STORIES_DIR, prompts, 2)
    assert len(one["tokens"]) == 3 and all(len(t) == 20 for t in one["tokens"])
    _same(one, two)


def test_tp2_gives_the_greedy_tokens_of_tp1_on_a_gqa_llama(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=301,  # odd: the second rank's vocabulary rows end in padding
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,  # q/k/v and o biases: column- and row-parallel biases
        tie_word_embeddings=False,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random weights large enough that greedy choices are not ties
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    prompts = [{"prompt_token_ids": [5, 17, 200, 3, 44]}, {"prompt_token_ids": [300, 1, 2]}]
    one, two = _greedy(tmp_path, prompts, 1), _greedy(tmp_path, prompts, 2)
    assert len(set(one["tokens"][0])) > 1  # the model does not just repeat one token
    _same(one, two)


def test_a_split_that_does_not_divide_is_a_clear_error() -> None:
    parallel_state._STATE = parallel_state.TensorParallel(0, 3)
    try:
        with pytest.raises(ConfigError, match="num_key_value_heads \\(4\\) must divide evenly"):
            parallel_state.divide(4, "num_key_value_heads")
    finally:
        parallel_state._STATE = parallel_state.TensorParallel()


def test_a_worker_rank_exits_when_its_engine_is_killed() -> None:
    """rank 0 SIGKILLed (as an engine process can be): its worker meets the broken connection
    in its next broadcast and exits, so a restarted engine never finds an orphan beside it."""
    script = (
        "import sys\n"
        "from qiao import LLM\n"
        "llm = LLM(sys.argv[1], profile=None, num_threads=1, tensor_parallel_size=2)\n"
        "print(llm.engine.runner.tp.pids[0], flush=True)\n"
        "sys.stdin.read()\n"  # wait to be killed
    )
    demo = REPO / "qiao" / "demo_model"
    engine = subprocess.Popen(
        [sys.executable, "-c", script, str(demo)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert engine.stdout is not None
        line = engine.stdout.readline()
        assert line.strip().isdigit(), engine.stderr.read()[-3000:] if engine.stderr else line
        worker = int(line)
        engine.kill()
        engine.wait(30)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{worker}").exists() and not _is_zombie(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its engine"
            time.sleep(0.1)
    finally:
        engine.kill()
        engine.wait(30)
