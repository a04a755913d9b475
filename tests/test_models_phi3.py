"""The Phi-3 family (Phi-3, Phi-4-mini) beyond the shared numerics of test_models_numerics.py:
config.json reading, LongRoPE and partial rotary against transformers, the fused checkpoint
names, greedy generation through `LLM` against transformers' `generate`, and int8.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import PHI4MINI_ORIGINAL_MAX_POSITIONS

from qiao import LLM, SamplingParams
from qiao.distributed import parallel_state
from qiao.errors import ConfigError, ModelLoadError
from qiao.layers.linear import LinearBase
from qiao.layers.rotary import RotaryEmbedding
from qiao.models import get_model_class, load_arch_config, load_model
from qiao.models.arch_config import ArchConfig
from qiao.models.loader import find_weight_files, iter_safetensors

# Phi-4-mini-instruct's config.json (transformers 4 keys), its factor lists shortened to fit a
# rotary dimension of 96 / 2 = 48 (the published lists have 48 entries too).
PHI4_MINI_CONFIG = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 200064,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "partial_rotary_factor": 0.75,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0] * 48,
        "long_factor": [1.0 + i for i in range(48)],
    },
    "sliding_window": 262144,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 199999,
    "eos_token_id": [200020, 199999],
    "torch_dtype": "bfloat16",
}


def test_phi4_mini_config_reads_partial_rotary_and_longrope():
    arch = ArchConfig.from_dict(PHI4_MINI_CONFIG)
    assert (arch.head_dim, arch.rotary_dim) == (128, 96)
    assert arch.fused_checkpoint and arch.tie_word_embeddings
    assert arch.sliding_window == 262144
    scaling = arch.rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 4096
    assert scaling["factor"] == 32.0  # max_position_embeddings / original, as transformers
    # Phi-3-128k's first configs said "su"; transformers reads it as LongRoPE.
    su = {**PHI4_MINI_CONFIG, "rope_scaling": {**PHI4_MINI_CONFIG["rope_scaling"], "type": "su"}}
    assert ArchConfig.from_dict(su).rope_scaling["rope_type"] == "longrope"


def test_phi3_config_without_scaling_rotates_whole_heads():
    d = {**PHI4_MINI_CONFIG, "rope_scaling": None, "partial_rotary_factor": None}
    d.pop("original_max_position_embeddings")
    arch = ArchConfig.from_dict(d)
    assert (arch.rotary_dim, arch.rope_scaling) == (128, None)


def test_longrope_factor_list_of_the_wrong_length_names_the_field():
    bad = {**PHI4_MINI_CONFIG["rope_scaling"], "short_factor": [1.0] * 64}
    with pytest.raises(ConfigError, match=r"rope_scaling\.short_factor: 64 values, expected 48"):
        ArchConfig.from_dict({**PHI4_MINI_CONFIG, "rope_scaling": bad})


def test_longrope_cos_sin_match_transformers_exactly_below_and_from_original_max():
    """qiao picks the factors per position; transformers per forward, by its last position: a
    forward of positions below original_max gets the short ones, one past it the long ones."""
    scaling = {k: v for k, v in PHI4_MINI_CONFIG["rope_scaling"].items() if k != "type"}
    config = transformers.Phi3Config(
        hidden_size=256,
        num_attention_heads=2,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", **scaling},
        pad_token_id=None,
    )
    hf_rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    arch = ArchConfig.from_dict(PHI4_MINI_CONFIG)
    with torch.device("meta"):
        rotary = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
    assert rotary.attention_scaling > 1.0  # sqrt(1 + log 32 / log 4096)
    short = torch.tensor([0, 1, 7, 63, 1000, 4095])
    long = torch.tensor([4096, 4097, 10000, 131071])
    x = torch.zeros(1, dtype=torch.float32)
    hf = [hf_rotary(x, positions[None]) for positions in (short, long)]
    cos, sin = rotary(torch.cat((short, long)), torch.float32)
    assert cos.shape == (10, 96)
    assert torch.equal(cos, torch.cat((hf[0][0][0], hf[1][0][0])))
    assert torch.equal(sin, torch.cat((hf[0][1][0], hf[1][1][0])))


def test_phi3_checkpoint_names_are_the_fused_ones(tiny_checkpoint):
    path = tiny_checkpoint("phi3")
    arch = load_arch_config(path)
    with torch.device("meta"):
        model = get_model_class(arch)(arch)
    model = model.to_empty(device="cpu")  # as the loader has it: before prepare_linears
    names = model.expected_weight_names()
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n or "gate_proj." in n for n in names)
    qkv = torch.zeros(arch.hidden_size + 1, arch.hidden_size)
    with pytest.raises(ModelLoadError, match=r"qkv_proj\.weight.*stacked shape \(129, 128\)"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", qkv)])


@pytest.mark.parametrize("rank", [0, 1])
def test_stacked_checkpoint_tensors_split_per_tensor_parallel_rank(tiny_checkpoint, rank):
    """Rank r of 2 keeps its heads of q, k and v and its half of gate and of up, as it would
    from separate q/k/v and gate/up tensors."""
    path = tiny_checkpoint("phi4mini")
    arch = load_arch_config(path)
    tensors = dict(iter_safetensors(find_weight_files(path)))
    parallel_state._STATE = parallel_state.TensorParallel(rank, 2)
    try:
        with torch.device("meta"):
            model = get_model_class(arch)(arch)
        model = model.to_empty(device="cpu")
        model.load_weights(tensors.items())
    finally:
        parallel_state._STATE = parallel_state.TensorParallel()
    q_rows, kv_rows = (
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
    )
    q, k, v = tensors["model.layers.1.self_attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
    expected = torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, expected)
    gate, up = tensors["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    expected = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, expected)


def test_partial_rotary_rotates_the_leading_dims_only(monkeypatch):
    """The C++ kernel (on a view of the leading dims) and the PyTorch path agree, and the
    trailing dims pass through untouched."""
    import qiao.layers.rotary as rotary_module

    rope = RotaryEmbedding(24, 10000.0, None)
    cos, sin = rope(torch.tensor([0, 5, 17, 300, 1023, 2]), torch.float32)
    qkv = torch.randn(6, 5 * 32)
    q = qkv[:, : 3 * 32].view(6, 3, 32)  # a strided view, as the model passes it
    x1, x2 = q[..., :12], q[..., 12:24]
    rotated = torch.cat(
        (
            x1 * cos[:, None, :12] - x2 * sin[:, None, :12],
            x2 * cos[:, None, 12:] + x1 * sin[:, None, 12:],
        ),
        dim=-1,
    )
    expected = torch.cat((rotated, q[..., 24:]), dim=-1)
    kernel_out = rotary_module.apply_rotary(q.clone(), cos, sin)
    monkeypatch.setattr(rotary_module, "ops_for", lambda x: None)
    torch_out = rotary_module.apply_rotary(q.clone(), cos, sin)
    for out in (kernel_out, torch_out):
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(out[..., 24:], q[..., 24:])


def _hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as ignore_eos
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.eval().generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        results.append(out[0, len(prompt) :].tolist())
    return results


def _prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=generator).tolist() for n in lengths]


def _greedy(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Phi-3: generations past its sliding window (40). Phi-4-mini: every sequence within
# original_max_position_embeddings (32), where transformers' `generate` keeps the short factors
# throughout (past it, its `generate` recomputes the whole cache with the long factors, which
# qiao does not: see qiao/layers/rotary.py and the test below).
GENERATE_CASES = {"phi3": ([3, 17, 32], 30), "phi4mini": ([3, 10, 16], 16)}


@pytest.mark.parametrize("arch_name", list(GENERATE_CASES))
def test_greedy_generation_equals_transformers_generate(tiny_checkpoint, arch_name):
    path = tiny_checkpoint(arch_name)
    lengths, max_tokens = GENERATE_CASES[arch_name]
    assert arch_name != "phi4mini" or max(lengths) + max_tokens <= PHI4MINI_ORIGINAL_MAX_POSITIONS
    prompts = _prompts(lengths)
    expected = _hf_greedy(path, prompts, max_tokens)
    for i, (out, ref) in enumerate(zip(_greedy(path, prompts, max_tokens), expected, strict=True)):
        assert out == ref, f"prompt {i} (length {lengths[i]}) diverges"


def _hf_greedy_with_cache(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding through transformers' forward and its KV cache, one token per forward
    (what `generate` does, less its Phi-3 recompute when the sequence passes original_max)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokens: list[int] = []
    with torch.no_grad():
        out = model.eval()(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values)
    return tokens


def test_phi4mini_greedy_past_original_max_equals_transformers_with_its_cache(tiny_checkpoint):
    """Past original_max_position_embeddings each new token rotates with the long factors and
    the cached keys keep theirs: transformers' forward over its KV cache, token by token."""
    path = tiny_checkpoint("phi4mini")
    prompts = _prompts([17, PHI4MINI_ORIGINAL_MAX_POSITIONS])
    outs = _greedy(path, prompts, 30)
    for i, (out, prompt) in enumerate(zip(outs, prompts, strict=True)):
        assert out == _hf_greedy_with_cache(path, prompt, 30), f"prompt {i} diverges"


@pytest.mark.parametrize("arch_name", ["phi3", "phi4mini"])
def test_int8_loads_and_generates(tiny_checkpoint, arch_name):
    path = tiny_checkpoint(arch_name)
    arch = load_arch_config(path)
    cpu = torch.device("cpu")
    dense = load_model(path, arch, dtype=torch.float32, device=cpu)
    int8 = load_model(path, arch, dtype=torch.float32, device=cpu, quantization="int8")
    linears = [m for m in int8.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.method.name == "int8" for m in linears)
    assert int8.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    # The same layers as the float model: int8 logits close to its (rounding error only).
    hidden = torch.randn(6, arch.hidden_size)
    with torch.inference_mode():
        ref = dense.compute_logits(hidden)
        diff = (int8.compute_logits(hidden) - ref).abs().max().item()
    assert diff <= 0.02 * ref.abs().max().item()
    llm = LLM(str(path), quantization="int8", profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(_prompts([3, 17, 32]), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [40, 40, 40]
