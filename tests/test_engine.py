"""End to end through `LLM`: real weights, transformers as the reference, batching invariants."""

from __future__ import annotations

import pytest
import torch

from qiao import LLM, SamplingParams
from qiao.errors import ConfigError, ModelLoadError

STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_IDS = [
    432,
    383,
    286,
    261,
    376,
    298,
    315,
    421,
    395,
    317,
    426,
    338,
    401,
    396,
    267,
    337,
    410,
    408,
    419,
    292,
    411,
    322,
    265,
    282,
    295,
    433,
    426,
    385,
    328,
    432,
    358,
    394,
]
STORIES_TEXT = (
    ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"
)
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def stories_llm(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=32)


def test_stories_greedy_matches_reference(stories_llm):
    (out,) = stories_llm.generate(["Once upon a time"], GREEDY_32, use_tqdm=False)
    assert out.prompt_token_ids == STORIES_PROMPT_IDS
    sample = out.outputs[0]
    assert sample.token_ids == STORIES_IDS
    assert sample.text == STORIES_TEXT
    assert sample.finish_reason == "length"


def test_stories_chat_equals_completion(stories_llm):
    (chat,) = stories_llm.chat(
        [{"role": "user", "content": "Once upon a time"}], GREEDY_32, use_tqdm=False
    )
    assert chat.prompt_token_ids == STORIES_PROMPT_IDS
    assert chat.outputs[0].text == STORIES_TEXT


def test_token_id_prompts_and_per_prompt_params(stories_llm):
    outs = stories_llm.generate(
        [STORIES_PROMPT_IDS, {"prompt_token_ids": STORIES_PROMPT_IDS}],
        [GREEDY_32, SamplingParams(temperature=0.0, max_tokens=5)],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].token_ids == STORIES_IDS
    assert outs[1].outputs[0].token_ids == STORIES_IDS[:5]


def test_stop_string_across_tokens_is_excluded(stories_llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["girl named"])
    (out,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.text == ", there was a little "
    assert sample.finish_reason == "stop" and sample.stop_reason == "girl named"
    kept = params.clone(include_stop_str_in_output=True)
    (out,) = stories_llm.generate("Once upon a time", kept, use_tqdm=False)
    assert out.outputs[0].text == ", there was a little girl named"


def test_stop_token_ids_and_min_tokens(stories_llm):
    params = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[261])
    (out,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    assert out.outputs[0].token_ids == STORIES_IDS[:4]
    assert out.outputs[0].stop_reason == 261
    # min_tokens bans the stop id until 5 tokens exist, so greedy takes the runner-up there.
    params = params.clone(min_tokens=5)
    (out,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    assert out.outputs[0].token_ids[:3] == STORIES_IDS[:3]
    assert 261 not in out.outputs[0].token_ids[:5]


def test_n_samples_seeded_are_reproducible_and_distinct(stories_llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=1234)
    (a,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    (b,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
    assert len({tuple(s.token_ids) for s in a.outputs}) > 1
    # Sample 0 of n=3 is the same draw as n=1 with the same seed.
    (one,) = stories_llm.generate("Once upon a time", params.clone(n=1), use_tqdm=False)
    assert one.outputs[0].token_ids == a.outputs[0].token_ids


def test_logprobs_match_transformers(stories_llm, stories_dir):
    transformers = pytest.importorskip("transformers")
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    (out,) = stories_llm.generate("Once upon a time", params, use_tqdm=False)
    sample = out.outputs[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    ids = torch.tensor([STORIES_PROMPT_IDS + sample.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = ref[len(STORIES_PROMPT_IDS) - 1 + step]
        assert entry[token].rank == 1
        top = torch.topk(row, 3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, logprob in entry.items():
            assert abs(logprob.logprob - row[tid].item()) < 1e-4
    assert sample.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True))
    )


def _hf_greedy(path, prompts, max_new_tokens):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # Like ignore_eos: EOS neither stops nor is suppressed (min_new_tokens would suppress it).
    model.generation_config.eos_token_id = None
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        results.append(out[0, len(prompt) :].tolist())
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_batch_equals_transformers_alone(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    g = torch.Generator().manual_seed(7)
    lengths = torch.linspace(1, 300, 16).round().int().tolist()
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    llm = LLM(str(path), max_num_seqs=16, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = _hf_greedy(path, prompts, 64)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} (length {lengths[i]}) diverges"


def _invariance_outputs(path, prompts, target, **llm_kwargs):
    llm = LLM(str(path), **llm_kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=99, ignore_eos=True)
    outs = llm.generate(prompts, [greedy] * len(prompts), use_tqdm=False)
    outs_seeded = llm.generate(prompts, [seeded] * len(prompts), use_tqdm=False)
    stats = llm.engine.stats()
    return outs[target].outputs[0].token_ids, outs_seeded[target].outputs[0].token_ids, stats


def test_batch_invariance_alone_batched_chunked_preempted(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 200, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 90, (32,), generator=g)
    ]
    target = 5
    alone = _invariance_outputs(path, [prompts[target]], 0, enable_prefix_caching=False)
    batched = _invariance_outputs(
        path, prompts, target, max_num_seqs=32, enable_prefix_caching=False
    )
    chunked = _invariance_outputs(
        path,
        prompts,
        target,
        max_num_seqs=32,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    # 14 blocks of 16 tokens: far less than 32 sequences need, so requests get preempted.
    preempted = _invariance_outputs(
        path, prompts, target, max_num_seqs=32, num_kv_blocks=14, enable_prefix_caching=False
    )
    assert preempted[2]["num_preemptions"] > 0
    for other in (batched, chunked, preempted):
        assert other[0] == alone[0]
        assert other[1] == alone[1]


def test_prefix_cache_computes_only_the_suffix(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 200, (256,), generator=g).tolist()
    first = prefix + [5, 6, 7]
    second = prefix + [8, 9, 10, 11, 12]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    cached = LLM(str(path))
    cached.generate([first], params, use_tqdm=False)
    before = cached.engine.stats()
    (hit,) = cached.generate([second], params, use_tqdm=False)
    assert hit.num_cached_tokens == 256
    assert (
        cached.engine.stats()["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 256
    )
    uncached = LLM(str(path), enable_prefix_caching=False)
    (miss,) = uncached.generate([second], params, use_tqdm=False)
    assert miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids


def test_all_blocks_free_after_finish_and_abort(stories_llm):
    engine = stories_llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50))
    engine.add_request("b", "Once upon a time", SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    outs = engine.abort_request(["a", "b"])
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ("x " * 600, {}, "max_model_len"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ([1, 99999], {}, "vocabulary"),
    ],
)
def test_bad_requests_name_the_field(stories_llm, prompt, params, field):
    with pytest.raises(ConfigError, match=field):
        stories_llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    assert not stories_llm.engine.has_unfinished_requests()


def test_bad_prompt_in_a_batch_cancels_the_whole_batch(stories_llm):
    with pytest.raises(ConfigError, match="prompt"):
        stories_llm.generate(["Once upon a time", ""], GREEDY_32, use_tqdm=False)
    assert not stories_llm.engine.has_unfinished_requests()


def test_bad_checkpoints_name_the_file(tmp_path, tiny_checkpoint):
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        LLM(str(tmp_path))
    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    src = tiny_checkpoint("llama")
    (pickle_dir / "config.json").write_text((src / "config.json").read_text())
    (pickle_dir / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin"):
        LLM(str(pickle_dir), skip_tokenizer_init=True)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        LLM(str(src), trust_remote_code=True)


def test_cli_generate_prints_reference(stories_dir, capsys):
    from qiao.cli import main

    rc = main(
        [
            "generate",
            "--model",
            str(stories_dir),
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "32",
        ]
    )
    assert rc == 0
    assert capsys.readouterr().out.strip() == "Once upon a time" + STORIES_TEXT


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    from qiao.cli import main

    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "qiao: error:" in err and "Traceback" not in err
