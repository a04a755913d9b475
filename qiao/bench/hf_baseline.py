"""The baseline: Hugging Face transformers on the same weights, in the same process.

`build_with_hf_twin` builds the transformers model from the same config.json and has qiao load
its weights, so both compute with identical numbers and a speed ratio compares code, not
weights.
"""

from __future__ import annotations

import dataclasses
import inspect
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qiao.bench.common import EngineArgs, build_llm
from qiao.errors import ConfigError

if TYPE_CHECKING:
    from qiao.entrypoints.llm import LLM


def build_llm_and_baseline(path: Path, args: EngineArgs, compare_hf: bool) -> tuple[LLM, Any]:
    """The engine under test and, with `compare_hf`, its HF twin (else None)."""
    if not compare_hf:
        return build_llm(path, args), None
    return build_with_hf_twin(path, args)


def build_with_hf_twin(path: Path, args: EngineArgs) -> tuple[LLM, Any]:
    """(qiao, transformers) on the same weights: `AutoModelForCausalLM.from_config(config.json
    at path)` in qiao's dtype, eval mode, its (random) weights saved as a safetensors checkpoint
    that qiao loads the way it loads any checkpoint (so packing and quantization apply)."""
    import transformers

    from qiao.hal.platform import resolve_dtype

    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(path)
    if args.device not in ("auto", "cpu"):
        # The HF side runs and is timed on the CPU (no device syncs in its timing).
        raise ConfigError("--compare hf needs --device cpu")
    dtype = resolve_dtype(
        args.dtype, getattr(config, "torch_dtype", None) and str(config.torch_dtype), "cpu"
    )
    # Cast after building: the dtype keyword of from_config differs across transformers versions.
    hf = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with tempfile.TemporaryDirectory(prefix="qiao-hf-twin-") as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        llm = build_llm(Path(tmp), dataclasses.replace(args, load_format="safetensors"))
    return llm, hf


def pad_token_id(hf: Any) -> int:
    config = hf.config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return candidate
    return 0


@torch.inference_mode()
def hf_generate(
    hf: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int
) -> tuple[float, int]:
    """Greedy `generate()` over `prompts` in static batches of `batch_size`, left-padded.

    Each batch generates exactly the largest `output_len` of its prompts (HF batches stop
    together), so shorter requests carry waste, as static batching does. Returns (seconds,
    tokens generated including that waste).
    """
    pad = pad_token_id(hf)
    seconds = 0.0
    generated = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        num_new = max(output_lens[start : start + batch_size])
        input_ids, attention_mask = _left_pad(batch, pad)
        begin = time.perf_counter()
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=pad,
        )
        seconds += time.perf_counter() - begin
        generated += (out.shape[1] - input_ids.shape[1]) * len(batch)
    return seconds, generated


def _left_pad(batch: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


@torch.inference_mode()
def hf_prefill_and_decode(
    hf: Any, prompt: list[int], num_decode_steps: int
) -> tuple[float, list[float]]:
    """One sequence through forward() with HF's KV cache: (prefill seconds, seconds of each
    greedy decode step). Calls the model directly, so `generate()`'s overhead is not counted
    against HF."""
    parameters = inspect.signature(hf.forward).parameters
    # Newer transformers 5 releases call the KV cache `cache`, earlier ones `past_key_values`.
    cache_name = "cache" if "cache" in parameters else "past_key_values"
    # Prefill logits for the last token only, as qiao computes them (named so since 4.50).
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    input_ids = torch.tensor([prompt])
    begin = time.perf_counter()
    out = hf(input_ids=input_ids, use_cache=True, **last_only)
    next_token = out.logits[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - begin
    steps: list[float] = []
    for _ in range(num_decode_steps):
        cache = {cache_name: getattr(out, cache_name)}
        begin = time.perf_counter()
        out = hf(input_ids=next_token, use_cache=True, **cache)
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        steps.append(time.perf_counter() - begin)
    return prefill, steps


@torch.inference_mode()
def hf_greedy_tokens(hf: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of one prompt by plain argmax over full forward passes: no logits
    processors (generate()'s min_new_tokens would mask EOS, which qiao's ignore_eos does not),
    no cache. For checking that qiao computes the same thing, not for timing."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = hf(input_ids=torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]
