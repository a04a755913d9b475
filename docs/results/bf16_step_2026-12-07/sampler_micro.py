"""The sampler alone on 152K-token bfloat16 logits (docs/benchmarks.md, the bfloat16 step):
median ms of 10 calls per setting, batch 1 and 64. Runs against any qiao checkout on PYTHONPATH.
"""

import time

import torch

from qiao.runner.sampler import Sampler, SamplingMetadata, SamplingRow
from qiao.sampling_params import SamplingParams

VOCAB = 151936
SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temp": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "logprobs": SamplingParams(temperature=0, logprobs=5),
}


def median_ms(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata) -> float:
    n = 10
    sampler(logits, metadata)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        sampler(logits, metadata)
        times.append(time.perf_counter() - start)
    return round(sorted(times)[n // 2] * 1e3, 2)


for batch in (1, 64):
    logits = torch.randn(batch, VOCAB).bfloat16()
    for name, params in SETTINGS.items():
        rows = [SamplingRow(params, i, [1, 2, 3], [4, 5], [0]) for i in range(batch)]
        metadata = SamplingMetadata.from_rows(rows, VOCAB, torch.device("cpu"))
        print(batch, name, median_ms(Sampler(), logits, metadata), "ms")
