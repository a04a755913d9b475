"""The bfloat16 offline run whose steps py-spy samples (docs/benchmarks.md, the bfloat16 step).

Qwen2.5-0.5B shape, random weights, 64 prompts x 128 random tokens, greedy, `ignore_eos`:
    py-spy record -r 50 -f raw -o raw.txt -- .venv/bin/python step_profile.py 64
then sum the samples under `LLMEngine.step` per function.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

from qiao import LLM, SamplingParams
from qiao.bench.shapes import write_shape_dir

shape_dir = Path(tempfile.mkdtemp())
write_shape_dir("qwen2.5-0.5b", shape_dir)
llm = LLM(
    str(shape_dir),
    load_format="dummy",
    skip_tokenizer_init=True,
    dtype="bfloat16",
    max_num_seqs=128,
    max_num_batched_tokens=2048,
)
g = torch.Generator().manual_seed(0)
prompts = [
    {"prompt_token_ids": torch.randint(0, 150000, (128,), generator=g).tolist()} for _ in range(64)
]
max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 32
params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
llm.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
for _ in range(2):
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"run: {time.perf_counter() - start:.2f} s")
