"""`qiao bench quality`: what a quantization or a narrower KV cache costs, measured against
the float32 model.

Two measures on the same checkpoint, one engine each (float32, and the variant: int8 weights,
a bfloat16 / float16 KV cache, or both):
- greedy agreement: each prompt's greedy continuation under the variant against the
  float32 one — the share of prompts whose whole output is identical, the share of output
  positions that agree, and the mean length of the agreeing prefix;
- perplexity of a fixed text (teacher-forced, 16 tokens per step as a chunked prefill runs, so
  every chunk after the first attends to K/V read back from the cache), float32 and the variant,
  and the relative change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from qiao.attention.metadata import AttentionMetadata
from qiao.errors import ConfigError

if TYPE_CHECKING:
    from qiao.entrypoints.llm import LLM

# Story openings in the style of TinyStories, for models trained on children's stories.
DEFAULT_PROMPTS = (
    "Once upon a time",
    "One day, a little girl named Lily",
    "Tom had a big red ball.",
    "The sun was shining and the birds",
    "There was a small dog who",
    "Mom said, \"Let's go to the park",
    "Ben and Mia wanted to build",
    "In a little house in the woods",
    "The cat saw a bird in the tree.",
    "Sara found a shiny stone",
    "It was a rainy day, so",
    "The little boy was sad because",
)

DEFAULT_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friend Tom. One day, they found a big box under a tree. Lily said, \"Let's "
    'open it!" Tom was scared, but he wanted to see what was inside. They opened the box '
    "together and saw a small puppy. The puppy was sad and hungry. Lily gave him some bread, "
    "and the puppy was happy. He wagged his tail and licked her face. Tom laughed and said, "
    '"He likes you!" They took the puppy home to Lily\'s mom. Mom smiled and said they could '
    "keep him. Lily named the puppy Max. Every day, Lily, Tom and Max played in the park, and "
    "they were the best of friends."
)


PERPLEXITY_CHUNK = 16  # tokens per forward in the perplexity measure


@dataclass(frozen=True)
class QualityConfig:
    model: str
    quantization: str | None = "int8"
    max_tokens: int = 64
    kv_cache_dtype: str = "auto"


@dataclass
class QualityReport:
    model: str
    quantization: str | None
    num_prompts: int
    max_tokens: int
    exact_match_prompts: float  # share of prompts with identical greedy output
    token_agreement: float  # share of output positions with the same token
    mean_agreeing_prefix: float  # mean number of leading output tokens that agree
    text_tokens: int
    perplexity_float32: float
    perplexity_quantized: float
    perplexity_change: float  # relative: quantized / float32 - 1
    outputs: list[dict[str, Any]] = field(default_factory=list)
    kv_cache_dtype: str = "auto"
    variant: str = ""  # what was measured, e.g. "int8", "KV bfloat16", "int8, KV bfloat16"


def run_quality(cfg: QualityConfig) -> dict[str, Any]:
    """The `qiao bench quality` report: `measure_quality` on the default prompts and text."""
    return asdict(
        measure_quality(
            cfg.model,
            cfg.quantization,
            max_tokens=cfg.max_tokens,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
    )


def variant_name(quantization: str | None, kv_cache_dtype: str) -> str:
    """E.g. "int8", "KV bfloat16", "int8, KV bfloat16"; "" for plain float32."""
    parts = [quantization] if quantization else []
    if kv_cache_dtype not in ("auto", "float32"):
        parts.append(f"KV {kv_cache_dtype}")
    return ", ".join(parts)


def measure_quality(
    model: str,
    quantization: str | None = "int8",
    *,
    prompts: tuple[str, ...] = DEFAULT_PROMPTS,
    max_tokens: int = 64,
    text: str = DEFAULT_TEXT,
    kv_cache_dtype: str = "auto",
) -> QualityReport:
    """Float32 vs the variant (`quantization` and / or `kv_cache_dtype`) on checkpoint `model`
    (which needs its tokenizer)."""
    variant = variant_name(quantization, kv_cache_dtype)
    if not variant:
        raise ConfigError(
            "nothing to compare: set a quantization (--quantization int8) or a kv_cache_dtype "
            "narrower than float32 (--kv-cache-dtype bfloat16|float16)"
        )
    reference = _greedy_and_perplexity(model, None, "auto", prompts, max_tokens, text)
    quantized = _greedy_and_perplexity(
        model, quantization, kv_cache_dtype, prompts, max_tokens, text
    )
    ref_out, ref_ppl, num_text = reference
    q_out, q_ppl, _ = quantized
    agree = [_agreeing_prefix(a, b) for a, b in zip(ref_out, q_out, strict=True)]
    same = sum(
        sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(ref_out, q_out, strict=True)
    )
    total = sum(max(len(a), len(b)) for a, b in zip(ref_out, q_out, strict=True))
    return QualityReport(
        model=model,
        quantization=quantization,
        num_prompts=len(prompts),
        max_tokens=max_tokens,
        exact_match_prompts=sum(a == b for a, b in zip(ref_out, q_out, strict=True)) / len(prompts),
        token_agreement=same / max(total, 1),
        mean_agreeing_prefix=sum(agree) / len(agree),
        text_tokens=num_text,
        perplexity_float32=ref_ppl,
        perplexity_quantized=q_ppl,
        perplexity_change=q_ppl / ref_ppl - 1.0,
        outputs=[
            {"prompt": p, "float32": a, variant: b, "agreeing_prefix": n}
            for p, a, b, n in zip(prompts, ref_out, q_out, agree, strict=True)
        ],
        kv_cache_dtype=kv_cache_dtype,
        variant=variant,
    )


def format_quality(report_dict: dict[str, Any]) -> str:
    report = QualityReport(**report_dict)
    return "\n".join(
        [
            f"Quality of {report.variant} against float32, {report.model}",
            f"  greedy, {report.num_prompts} prompts x {report.max_tokens} tokens:",
            f"    identical outputs        {report.exact_match_prompts:7.1%}",
            f"    agreeing positions       {report.token_agreement:7.1%}",
            f"    mean agreeing prefix     {report.mean_agreeing_prefix:7.1f} tokens",
            f"  perplexity over {report.text_tokens} tokens of text:",
            f"    float32                  {report.perplexity_float32:9.4f}",
            f"    {report.variant:<24} {report.perplexity_quantized:9.4f}",
            f"    change                   {report.perplexity_change:+8.2%}",
        ]
    )


def _greedy_and_perplexity(
    model: str,
    quantization: str | None,
    kv_cache_dtype: str,
    prompts: tuple[str, ...],
    max_tokens: int,
    text: str,
) -> tuple[list[list[int]], float, int]:
    from qiao import SamplingParams
    from qiao.entrypoints.llm import LLM

    kwargs: dict[str, Any] = {"dtype": "float32", "profile": None}
    kwargs["kv_cache_dtype"] = kv_cache_dtype
    if quantization is not None:
        kwargs["quantization"] = quantization
    llm = LLM(model, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(list(prompts), params)]
    token_ids = llm.get_tokenizer().encode(text)
    ppl = perplexity(llm, token_ids, chunk=PERPLEXITY_CHUNK)
    return [list(o) for o in outputs], ppl, len(token_ids)


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: list[int], chunk: int | None = None) -> float:
    """exp(mean negative log-likelihood) of tokens 1.. given their prefixes: one prefill, or
    `chunk` tokens per forward (each chunk attends to the earlier ones through the cache).

    Runs the engine's model directly over blocks 0.. of its KV pool, so call it with nothing
    else running on `llm`.
    """
    runner = llm.engine.runner
    n = len(token_ids)
    block_size = runner.block_size
    num_blocks = -(-n // block_size)
    if n < 2 or num_blocks > llm.engine.num_kv_blocks or n > llm.engine.max_model_len:
        raise ValueError(f"a text of {n} tokens does not fit this engine's context and KV pool")
    device = runner.device
    ids = torch.tensor(token_ids, device=device)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    hidden = []
    step = chunk or n
    for start in range(0, n, step):
        end = min(start + step, n)
        # One sequence over blocks 0, 1, ...: token i sits in slot i.
        positions = torch.arange(start, end, device=device)
        metadata = AttentionMetadata(
            num_tokens=end - start,
            num_seqs=1,
            block_size=block_size,
            slot_mapping=positions,
            positions=positions,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=block_tables,
            query_start_loc_cpu=np.array([0, end - start], np.int64),
            seq_lens_cpu=np.array([end], np.int64),
            max_query_len=end - start,
            max_seq_len=end,
        )
        hidden.append(runner.model(ids[start:end], positions, metadata))
    hidden = torch.cat(hidden)
    logprobs = torch.log_softmax(runner.model.compute_logits(hidden[:-1]).float(), dim=-1)
    nll = -logprobs.gather(1, ids[1:, None]).mean().item()
    return math.exp(nll)


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
