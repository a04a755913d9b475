"""Batch invariance (`batch_invariant=True`): a row's result does not depend on the rows beside
it, so greedy output does not depend on what else a step holds (qiao/layers/linear_method.py,
CpuInvariantBackend). The reference is the same row computed alone, compared bit for bit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qiao
from qiao.errors import ConfigError
from qiao.layers.linear import LinearBase
from qiao.layers.linear_method import INVARIANT_TILE, choose_method, onednn_linear_available

DEMO_DIR = Path(qiao.__file__).parent / "demo_model"
ROWS = [1, 2, 3, 7, INVARIANT_TILE - 1, INVARIANT_TILE, INVARIANT_TILE + 1, 64, 100]


def _layer(n: int, k: int, dtype: torch.dtype, *, quantization: str | None) -> LinearBase:
    torch.manual_seed(0)
    layer = LinearBase(k, n, bias=True)
    layer.weight.data = (torch.randn(n, k) * 0.05).to(dtype)
    layer.bias.data = torch.randn(n).to(dtype)
    layer.method = choose_method(
        layer.weight, quantization=quantization, batch_hint=64, batch_invariant=True
    )
    layer.method.prepare(layer)
    return layer


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        (torch.float32, None),
        pytest.param(
            torch.bfloat16,
            None,
            marks=pytest.mark.skipif(
                not onednn_linear_available(torch.bfloat16), reason="no bfloat16 oneDNN matmul"
            ),
        ),
        (torch.float32, "int8"),
    ],
)
def test_each_row_of_an_invariant_linear_equals_the_row_alone(dtype, quantization) -> None:
    # Down-projection-like shape: the one whose rows changed with the row count on AMX.
    layer = _layer(256, 768, dtype, quantization=quantization)
    x = torch.randn(max(ROWS), 768).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(max(ROWS))])
        for rows in ROWS:
            together = layer(x[:rows])
            assert together.shape == (rows, 256)
            differing = (together != alone[:rows]).any(dim=1).nonzero().flatten().tolist()
            assert differing == [], f"{layer.method.name}: rows {differing} of {rows} differ"
        # Leading dimensions are kept.
        assert torch.equal(layer(x[:34].reshape(2, 17, 768)).reshape(34, 256), alone[:34])


def test_batch_invariance_off_the_cpu_is_refused() -> None:
    weight = torch.empty(8, 8, device="meta")
    with pytest.raises(ConfigError, match="batch_invariant runs on the CPU only"):
        choose_method(weight, quantization=None, batch_hint=8, batch_invariant=True)


def _prompts(count: int) -> list[str]:
    rng = random.Random(5)
    words = ["the", "fox", "king", "river", "small", "dog", "ran", "sun", "girl", "tree"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(count)]


_GENERATE = """
import json, sys
from qiao import LLM, SamplingParams
prompts, shape = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(sys.argv[3], batch_invariant=True, max_model_len=64, **shape)
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
outputs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""


def test_greedy_output_does_not_depend_on_the_batch() -> None:
    """The same prompts through engines whose steps hold very different batches: up to 32
    sequences and whole prompts, one sequence at a time, and prompts cut into 5-token chunks
    beside decodes with no prefix cache. Every answer is the same token for token. Each engine
    runs in its own process, as the runs of a resumed `qiao batch run` do."""
    prompts = _prompts(48)
    shapes = [
        {"max_num_seqs": 32},
        {"max_num_seqs": 1},
        {"max_num_seqs": 7, "max_num_batched_tokens": 5, "enable_prefix_caching": False},
    ]
    answers = []
    for shape in shapes:
        argv = [json.dumps(prompts), json.dumps(shape), str(DEMO_DIR)]
        done = subprocess.run(
            [sys.executable, "-c", _GENERATE, *argv], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        answers.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert len(answers[0]) == 48 and all(len(a) == 24 for a in answers[0])
    assert answers[1] == answers[0]
    assert answers[2] == answers[0]
