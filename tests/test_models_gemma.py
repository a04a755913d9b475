"""Gemma 2 and Gemma 3 (text) beyond the shared numerics of test_models_numerics.py: config.json
reading, soft-capped attention in every backend against transformers' eager Gemma 2 attention,
the caps and the per-layer windows mattering in the tiny models, greedy generation through `LLM`
against transformers' `generate`; and freeing the KV blocks that fall out of a window that every
layer has (a tiny Mistral, a Gemma 3 whose layers all slide), prefix cache included.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from conftest import TINY_VOCAB_SIZE, build_attn_metadata, build_tiny_checkpoint
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from qiao import LLM, SamplingParams
from qiao.attention.backends.padded_decode import padded_decode_attention
from qiao.engine.block_manager import BlockManager
from qiao.engine.request import Request
from qiao.errors import ConfigError
from qiao.kernels import cpu_ops
from qiao.models import load_arch_config, load_model
from qiao.models.arch_config import ArchConfig
from qiao.sampling_params import SamplingParams as RequestParams

# Gemma-2-2b's config.json (transformers 4 keys: no layer_types, hidden_act and
# hidden_activation both).
GEMMA2_2B_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
    "bos_token_id": 2,
    "eos_token_id": [1, 107],
    "torch_dtype": "float32",
}

# Gemma-3-1b-it's (transformers 4 keys: sliding_window_pattern, rope_local_base_freq) with the
# linear RoPE scaling of the larger Gemma 3 models.
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "torch_dtype": "bfloat16",
}


def test_gemma2_config_alternates_windows_and_reads_the_caps():
    arch = ArchConfig.from_dict(GEMMA2_2B_CONFIG)
    assert arch.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    assert [arch.layer_sliding_window(i) for i in range(3)] == [4096, None, 4096]
    assert arch.uniform_sliding_window is None  # global layers need every block
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)
    assert arch.query_pre_attn_scalar == 256.0
    assert arch.tie_word_embeddings and not arch.qk_norm
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.rope_local_theta is None


def test_gemma3_config_reads_pattern_and_both_rope_bases():
    arch = ArchConfig.from_dict(GEMMA3_CONFIG)
    full = [i for i, t in enumerate(arch.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23]  # one global layer in every 6, as transformers
    assert arch.qk_norm and arch.tie_word_embeddings
    assert (arch.rope_theta, arch.rope_local_theta) == (1000000.0, 10000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # transformers 5 keys: rope_parameters by layer type, explicit layer_types.
    v5 = {
        **{k: v for k, v in GEMMA3_CONFIG.items() if not k.startswith("rope")},
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    }
    arch = ArchConfig.from_dict(v5)
    assert (arch.rope_theta, arch.rope_local_theta, arch.rope_scaling) == (500000.0, 20000.0, None)
    assert arch.uniform_sliding_window == 512  # every layer slides: blocks can be freed


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": ["sliding_attention"]}, "layer_types: need 26"),
        ({"layer_types": ["local"] * 26}, "layer_types"),
        ({"hidden_activation": "relu"}, "hidden_act.*gelu_pytorch_tanh"),
        ({"sliding_window": None}, "sliding_window: required"),
        (
            {"rope_local_base_freq": None, "rope_parameters": None, "rope_scaling": None}
            | {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                    "full_attention": {"rope_type": "default"},
                }
            },
            "rope_parameters.sliding_attention",
        ),
    ],
)
def test_bad_gemma_configs_name_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        ArchConfig.from_dict({**GEMMA3_CONFIG, **change})


# --- soft-capped attention against transformers' eager Gemma 2 attention ---


class _Heads(torch.nn.Module):
    """What eager_attention_forward reads off its module."""

    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = num_heads // num_kv_heads
        self.training = False


def _hf_attention(q, k, v, query_lens, seq_lens, scale, softcap, window):
    """transformers' eager Gemma 2 attention per sequence over its whole K/V: [T, H, D]."""
    out, start, kv_start = [], 0, 0
    module = _Heads(q.shape[1], k.shape[1])
    for n, s in zip(query_lens, seq_lens, strict=True):
        qs = q[start : start + n].transpose(0, 1)[None]
        ks = k[kv_start : kv_start + s].transpose(0, 1)[None]
        vs = v[kv_start : kv_start + s].transpose(0, 1)[None]
        qpos = torch.arange(s - n, s)[:, None]
        kpos = torch.arange(s)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        mask = torch.zeros(n, s).masked_fill(~visible, float("-inf"))[None, None]
        o, _ = eager_attention_forward(
            module, qs, ks, vs, mask, dropout=0.0, scaling=scale, softcap=softcap
        )
        out.append(o[0])
        start, kv_start = start + n, kv_start + s
    return torch.cat(out)


def _paged_case(head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A step of decode rows and prompt chunks after cached context, its K/V paged into a
    NaN-filled, block-shuffled cache; scores large enough that a cap of 4 bends them."""
    generator = torch.Generator().manual_seed(seed)
    # Decode rows, chunks after cached context (one crossing the window), a fresh prompt.
    query_lens, seq_lens = [1, 5, 1, 20, 17], [9, 40, 33, 50, 17]
    block_size, heads, kv_heads = 16, 4, 2
    num_blocks = 24
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    k = torch.randn(sum(seq_lens), kv_heads, head_dim, generator=generator) * 2
    v = torch.randn(sum(seq_lens), kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=generator) * 2
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    kv_start = 0
    for s, table in zip(seq_lens, tables, strict=True):
        for p in range(s):
            cache[:, table[p // block_size], p % block_size] = torch.stack(
                (k[kv_start + p], v[kv_start + p])
            )
        kv_start += s
    metadata = build_attn_metadata(query_lens, seq_lens, tables, block_size)
    # The new tokens' rows of k / v: sequence i's last query_lens[i] of its seq_lens[i].
    offsets = torch.tensor([0, *seq_lens[:-1]]).cumsum(0).tolist()
    lens = zip(offsets, query_lens, seq_lens, strict=True)
    rows = torch.cat([torch.arange(o + s - n, o + s) for o, n, s in lens])
    case = dict(q=q, k=k, v=v, rows=rows, query_lens=query_lens, seq_lens=seq_lens)
    return case, cache.to(dtype), metadata


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize(
    ("backend", "head_dim", "dtype"),
    [
        ("torch", 32, torch.float32),
        ("cpu", 32, torch.float32),  # the AVX-512 kernel where the CPU has it
        ("cpu", 24, torch.float32),  # the scalar kernel (no vectorised head size 24)
        ("cpu", 32, torch.bfloat16),
    ],
)
def test_softcapped_attention_matches_transformers_eager(backend, head_dim, dtype, window):
    if backend == "cpu" and cpu_ops() is None:
        pytest.skip("the C++ CPU kernels are not available (QIAO_DISABLE_CPU_KERNELS or no build)")
    from qiao.attention.registry import get_attention_backend

    case, cache, metadata = _paged_case(head_dim, dtype)
    q, k, v, rows = case["q"], case["k"], case["v"], case["rows"]
    scale, softcap = head_dim**-0.5, 4.0
    expected = _hf_attention(q, k, v, case["query_lens"], case["seq_lens"], scale, softcap, window)
    uncapped = _hf_attention(q, k, v, case["query_lens"], case["seq_lens"], scale, None, window)
    assert (expected - uncapped).abs().max() > 0.1  # the cap bends these scores
    out = get_attention_backend(backend).forward(
        q.to(dtype),
        k[rows].to(dtype),
        v[rows].to(dtype),
        cache,
        metadata,
        scale=scale,
        num_kv_heads=k.shape[1],
        sliding_window=window,
        softcap=softcap,
    )
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)


def test_padded_decode_softcap_matches_the_reference():
    case, cache, metadata = _paged_case(32, torch.float32)
    decode = [0, 2]  # the one-token rows
    rows = torch.tensor([0, 6])  # their rows in the flat batch
    q = case["q"][rows]
    scale, softcap = 32**-0.5, 4.0
    tables = metadata.block_tables[decode]
    seq_lens = metadata.seq_lens[decode]
    expected = _hf_attention(
        q,
        torch.cat([case["k"][:9], case["k"][49:82]]),
        torch.cat([case["v"][:9], case["v"][49:82]]),
        [1, 1],
        [9, 33],
        scale,
        softcap,
        12,
    )
    out = padded_decode_attention(q, cache, tables, seq_lens, scale, 12, softcap)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# --- the tiny models: the caps and the windows matter ---


def _logits(path, tokens: list[int], **arch_changes) -> torch.Tensor:
    arch = dataclasses.replace(load_arch_config(path), **arch_changes)
    model = load_model(path, arch, dtype=torch.float32, device=torch.device("cpu"))
    shape = (2, 8, 16, arch.num_key_value_heads, arch.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(arch.num_hidden_layers)])
    metadata = build_attn_metadata([len(tokens)], [len(tokens)], [list(range(8))], 16)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), metadata.positions, metadata))


def _hf_logits(path, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def test_gemma2_caps_and_window_each_change_the_logits(tiny_checkpoint):
    """qiao matches transformers on a prompt past the window (20 < 60); the same model with
    either cap or the window dropped does not: each is exercised, not just carried."""
    path = tiny_checkpoint("gemma2")
    tokens = torch.randint(0, TINY_VOCAB_SIZE, (60,), generator=torch.Generator().manual_seed(3))
    tokens = tokens.tolist()
    expected = _hf_logits(path, tokens)
    torch.testing.assert_close(_logits(path, tokens), expected, atol=1e-4, rtol=0)
    arch = load_arch_config(path)
    assert arch.layer_types == ("sliding_attention", "full_attention")
    for change in (
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"layer_types": ("full_attention", "full_attention")},
    ):
        assert (_logits(path, tokens, **change) - expected).abs().max() > 1e-2, change


def test_gemma3_local_rope_base_and_window_matter(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    tokens = torch.randint(0, TINY_VOCAB_SIZE, (60,), generator=torch.Generator().manual_seed(4))
    tokens = tokens.tolist()
    expected = _hf_logits(path, tokens)
    torch.testing.assert_close(_logits(path, tokens), expected, atol=1e-4, rtol=0)
    for change in (
        {"rope_local_theta": None},
        {"layer_types": ("full_attention", "full_attention")},
    ):
        assert (_logits(path, tokens, **change) - expected).abs().max() > 1e-2, change


# --- greedy generation through LLM against transformers' generate ---


def _prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]


def _hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            results.append(out[0, len(prompt) :].tolist())
    return results


def _greedy(path, prompts: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, profile=None, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch_name", ["gemma2", "gemma3"])
def test_greedy_generation_equals_transformers_generate(tiny_checkpoint, arch_name):
    """Prompts below, across and past the window (20 / 24), generations well past it."""
    path = tiny_checkpoint(arch_name)
    lengths = [3, 22, 41]
    prompts = _prompts(lengths)
    expected = _hf_greedy(path, prompts, 30)
    for i, (out, ref) in enumerate(zip(_greedy(path, prompts, 30), expected, strict=True)):
        assert out == ref, f"prompt {i} (length {lengths[i]}) diverges"


# --- blocks out of a window every layer has are freed ---


class _PeakBlocks:
    """Records the most blocks each request holds after any allocation, checking the pool's
    bookkeeping each time."""

    def __init__(self, monkeypatch) -> None:
        self.peak: dict[str, int] = {}
        allocate = BlockManager.allocate_slots
        recorder = self

        def allocate_slots(self, request, *args, **kwargs):
            ok = allocate(self, request, *args, **kwargs)
            self.check_invariants()
            held = self.num_blocks_held(request.request_id)
            recorder.peak[request.request_id] = max(recorder.peak.get(request.request_id, 0), held)
            return ok

        monkeypatch.setattr(BlockManager, "allocate_slots", allocate_slots)


def test_windowed_mistral_frees_blocks_and_generates_transformers_tokens(
    tiny_checkpoint, monkeypatch
):
    """Window 24, blocks of 16: a 10-token prompt generating 120 tokens holds at most 3 blocks
    (the window's 24 positions straddle at most 2, plus the block being filled) instead of 9,
    and its tokens equal transformers' and those of the same engine without freeing."""
    path = tiny_checkpoint("mistral")
    assert load_arch_config(path).uniform_sliding_window == 24
    prompts = _prompts([10, 30])
    expected = _hf_greedy(path, prompts, 120)
    peak = _PeakBlocks(monkeypatch)
    assert _greedy(path, prompts, 120) == expected
    assert max(peak.peak.values()) <= 3, peak.peak
    monkeypatch.setattr(ArchConfig, "uniform_sliding_window", property(lambda self: None))
    peak.peak.clear()
    assert _greedy(path, prompts, 120) == expected
    assert max(peak.peak.values()) == -(-(30 + 120 - 1) // 16)  # every block kept: 10


def test_all_sliding_gemma3_frees_blocks(tmp_path, monkeypatch):
    """A Gemma 3 whose layers all slide (window 24) frees blocks like Mistral, and still
    generates transformers' tokens."""
    from conftest import _train_tokenizer

    path = build_tiny_checkpoint("gemma3", tmp_path / "gemma3", _train_tokenizer(TINY_VOCAB_SIZE))
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "sliding_attention"]
    (path / "config.json").write_text(json.dumps(config))
    assert load_arch_config(path).uniform_sliding_window == 24
    prompts = _prompts([12])
    expected = _hf_greedy(path, prompts, 80)
    peak = _PeakBlocks(monkeypatch)
    assert _greedy(path, prompts, 80) == expected
    assert max(peak.peak.values()) <= 3, peak.peak


def _request(request_id: str, tokens: list[int]) -> Request:
    params = RequestParams(max_tokens=1)
    return Request(request_id, tokens, params, seed=0, eos_token_ids=(), max_total_tokens=64)


def test_freed_blocks_serve_as_prefix_only_while_they_hold_it():
    """A request's blocks freed out of the window stay in the prefix cache until reused: a
    second request with the same prompt takes back the ones still holding it, and its hit stops
    at the first one another request overwrote."""
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    prompt = list(range(40))
    a = _request("a", prompt)
    assert bm.allocate_slots(a, 20)  # 5 blocks
    a.num_computed_tokens = 20
    # Next token at 20 sees positions > 14: blocks 0-2 (positions 0-11) are out.
    assert bm.allocate_slots(a, 4)
    bm.check_invariants()
    assert bm.num_blocks_held("a") == 3
    ids = bm.get_block_ids("a")
    assert ids[:3] == [0, 0, 0] and len(ids) == 6
    b = _request("b", prompt[:21])
    hits, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 20 and len(hits) == 5  # blocks 0-2 still hold the prefix, 3-4 are a's
    # A third request takes free blocks: the least recently freed, a's block 2 last of them.
    c = _request("c", [99] * 12)
    assert bm.allocate_slots(c, 12)
    bm.check_invariants()
    reused = set(bm.get_block_ids("c"))
    assert reused & set(b.block_id for b in hits)  # c took some of the freed prefix blocks
    hits_d, num_hit = bm.get_computed_blocks(_request("d", prompt[:21]))
    assert num_hit < 20 and num_hit == 4 * len(hits_d)
    assert hits_d == hits[: len(hits_d)]  # the chain up to the first reused block
    assert not reused & set(b.block_id for b in hits_d)


def test_freeing_with_chunked_prefill_and_prefix_hits_keeps_transformers_tokens(
    tiny_checkpoint, monkeypatch
):
    """A 150-token prompt prefilled in chunks of 64 frees blocks between chunks; in a pool of
    12 blocks, freed blocks are reused while the same prompt comes again (beside itself in one
    step, then alone, taking prefix hits where freed blocks still hold it): every generation
    equals transformers'."""
    path = tiny_checkpoint("mistral")
    prompt, other = _prompts([150, 20])
    expected, expected_other = _hf_greedy(path, [prompt, other], 40)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=12, profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    peak = _PeakBlocks(monkeypatch)
    outs = llm.generate([prompt, prompt, other], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected, expected, expected_other]
    # A chunk of 64 after the window's 24 positions: at most ceil(87 / 16) + 1 blocks.
    assert max(peak.peak.values()) <= 7, peak.peak
    again = llm.generate([prompt], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected
    assert llm.engine.block_manager.num_hit_tokens > 0  # the prefix cache served some of it


@pytest.mark.parametrize("arch_name", ["gemma2", "gemma3"])
def test_tp2_gives_the_greedy_tokens_of_tp1(tiny_checkpoint, arch_name):
    """Split over 2 gloo ranks (2 of the 4 heads and 1 of the 2 kv heads each; the caps, the
    q/k norms and the windows per rank), prompts past the window: the tokens of one rank."""
    from test_tensor_parallel import _greedy as greedy_tp
    from test_tensor_parallel import _same

    path = tiny_checkpoint(arch_name)
    prompts = [{"prompt_token_ids": p} for p in _prompts([30, 7])]
    one, two = greedy_tp(path, prompts, 1), greedy_tp(path, prompts, 2)
    assert len(set(one["tokens"][0])) > 1
    _same(one, two)
