"""`kv_cache_dtype`: the KV cache stored narrower than the weights.

The quality bounds are the figures `qiao bench quality --quantization none --kv-cache-dtype ...`
measured on the real stories260K weights (12 prompts x 64 greedy tokens; perplexity over 274
tokens scored 16 per step), with a margin:
- bfloat16: 9/12 outputs identical, mean agreeing prefix 51.7 tokens, perplexity +0.09 %;
- float16: 12/12 identical, perplexity -0.00 %.
The kernels themselves are checked against float64 oracles in test_cpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from qiao import LLM, SamplingParams
from qiao.bench.quality import measure_quality
from qiao.cli import main
from qiao.errors import ConfigError


def test_pool_is_stored_in_the_kv_dtype_and_holds_twice_the_blocks(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    memory = 4 << 20
    wide = LLM(path, dtype="float32", kv_cache_memory=memory, profile=None)
    narrow = LLM(
        path, dtype="float32", kv_cache_memory=memory, kv_cache_dtype="bfloat16", profile=None
    )
    assert wide.engine.runner.kv_caches[0].dtype == torch.float32
    assert narrow.engine.runner.kv_caches[0].dtype == torch.bfloat16
    assert narrow.engine.num_kv_blocks == 2 * wide.engine.num_kv_blocks
    # Weights and activations stay float32; only the cache narrows.
    assert next(narrow.engine.runner.model.parameters()).dtype == torch.float32
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = narrow.generate(["hello world"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_unknown_kv_cache_dtype_is_a_config_error_naming_it(tiny_checkpoint):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(tiny_checkpoint("llama")), kv_cache_dtype="int4", profile=None)


def test_bfloat16_kv_cache_quality_on_stories260k_stays_within_measured_bounds(stories_dir):
    report = measure_quality(str(stories_dir), None, kv_cache_dtype="bfloat16")
    assert report.variant == "KV bfloat16"
    assert report.perplexity_float32 == pytest.approx(3.2207, rel=1e-3)
    assert abs(report.perplexity_change) <= 0.005
    assert report.perplexity_change != 0.0  # the cache is read: rounding shows, a little
    assert report.exact_match_prompts >= 6 / 12
    assert report.mean_agreeing_prefix >= 40


def test_float16_kv_cache_quality_on_stories260k_stays_within_measured_bounds(stories_dir):
    report = measure_quality(str(stories_dir), None, kv_cache_dtype="float16")
    assert abs(report.perplexity_change) <= 0.001
    assert report.exact_match_prompts >= 10 / 12


def test_quality_needs_something_to_compare(stories_dir, capsys):
    with pytest.raises(ConfigError, match="nothing to compare"):
        measure_quality(str(stories_dir), None, kv_cache_dtype="float32")
    # The command says so too, naming the flags, before loading anything.
    argv = ["bench", "quality", "--model", str(stories_dir), "--quantization", "none"]
    assert main(argv) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


# --- prefix_cache_reserve: how much of the pool freed blocks may fill before fresh ones ---------


def test_prefix_cache_reserve_bounds_the_blocks_a_workload_touches(tiny_checkpoint):
    from qiao.api.server import engine_config
    from qiao.api.settings import load_settings
    from qiao.sampling_params import SamplingParams

    model = str(tiny_checkpoint("llama"))
    config, _ = engine_config(
        load_settings(["--model", model, "--prefix-cache-reserve", "0.25", "--no-profile"])
    )
    assert config.cache.prefix_cache_reserve == 0.25
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[10 + i, 11 + i, 12 + i, 13 + i] * 5 for i in range(60)]  # 20 tokens, distinct

    def touched(reserve: float) -> tuple[int, list]:
        llm = LLM(model, num_kv_blocks=256, device="cpu", prefix_cache_reserve=reserve)
        bm = llm.engine.block_manager
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one at a time
        bm.check_invariants()
        return bm.next_fresh, [o.outputs[0].token_ids for o in outs]

    # 2 blocks per request (28 tokens of 16): the full first one is cached when freed, the
    # partial tail is not and is reused at once. Warm-first touches the reserve (26) and a
    # little more; filling the whole pool first touches a fresh block per request. Same outputs.
    bounded, bounded_out = touched(0.1)
    whole, whole_out = touched(1.0)
    assert bounded <= 26 + 2 * 2 and whole == len(prompts) + 1
    assert bounded_out == whole_out


def test_prefix_cache_reserve_out_of_range_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="prefix_cache_reserve"):
        LLM(str(tiny_checkpoint("llama")), prefix_cache_reserve=1.5)
