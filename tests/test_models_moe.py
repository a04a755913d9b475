"""The Qwen mixture-of-experts family (Qwen2-MoE, Qwen3-MoE) beyond the shared numerics of
test_models_numerics.py: the grouped dispatch against its dense reference, the router against
transformers', the sparse block (shared expert included) against transformers', dense layers
(`mlp_only_layers`, `decoder_sparse_step`), both checkpoint layouts of the experts, tensor-
parallel slices, greedy generation through `LLM` against transformers' `generate`, and int8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import _randomize
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from test_models_numerics import PagedRunner

from qiao import LLM, SamplingParams
from qiao.distributed import parallel_state
from qiao.errors import ConfigError, ModelLoadError
from qiao.layers.fused_moe import (
    FusedMoE,
    fused_moe_dense,
    fused_moe_reference,
    select_experts,
)
from qiao.models import get_model_class, load_arch_config, load_model
from qiao.models.arch_config import ArchConfig
from qiao.models.loader import find_weight_files, iter_safetensors
from qiao.models.qwen_moe import QwenMoeSparseBlock

ATOL = 1e-4


def _experts(num_experts: int, hidden: int, inter: int, seed: int) -> FusedMoE:
    generator = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts, hidden, inter)
    layer.gate_up_proj.data.normal_(0, 0.3, generator=generator)
    layer.down_proj.data.normal_(0, 0.3, generator=generator)
    return layer


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, renormalize: bool):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator) * 2
    return select_experts(logits, top_k, renormalize)


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    num_experts=st.integers(1, 12),
    top_k=st.integers(1, 4),
    renormalize=st.booleans(),
    prepared=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_dispatch_equals_the_dense_reference(
    num_tokens, num_experts, top_k, renormalize, prepared, seed
):
    """Unprepared (F.linear on the stacks) and prepared (each expert on the method a linear
    layer of its shape gets: on an AVX-512 CPU the packed float32 kernel)."""
    top_k = min(top_k, num_experts)
    layer = _experts(num_experts, 16, 8, seed)
    hidden = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(seed + 1))
    weights, ids = _routing(num_tokens, num_experts, top_k, seed + 2, renormalize)
    expected = fused_moe_reference(hidden, weights, ids, layer.gate_up_proj, layer.down_proj)
    # The sync-free form CUDA graphs capture.
    dense = fused_moe_dense(hidden, weights, ids, layer.gate_up_proj, layer.down_proj)
    torch.testing.assert_close(dense, expected, atol=1e-5, rtol=1e-5)
    if prepared:
        layer.prepare(None)
    with torch.inference_mode():
        out = layer(hidden, weights, ids)
    assert out.shape == (num_tokens, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_experts_that_receive_no_tokens_are_skipped():
    """3 tokens x 2 experts over 16: most experts get nothing; their weights are never read
    (NaN there would show) and the result is still the reference's."""
    layer = _experts(16, 16, 8, seed=3)
    hidden = torch.randn(3, 16)
    weights, ids = _routing(3, 16, 2, seed=4, renormalize=False)
    unused = sorted(set(range(16)) - set(ids.flatten().tolist()))
    assert len(unused) >= 10
    expected = fused_moe_reference(hidden, weights, ids, layer.gate_up_proj, layer.down_proj)
    layer.gate_up_proj.data[unused] = float("nan")
    layer.down_proj.data[unused] = float("nan")
    with torch.inference_mode():
        torch.testing.assert_close(layer(hidden, weights, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_router_equals_transformers_router_exactly(norm_topk_prob):
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=10, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(50, 32)
    _, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(hidden @ router.weight.T, 3, norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights)


def _qwen2_moe_config(**overrides) -> transformers.Qwen2MoeConfig:
    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    return transformers.Qwen2MoeConfig(**{**fields, **overrides})


def _arch(config) -> ArchConfig:
    return ArchConfig.from_dict({**config.to_dict(), "architectures": config.architectures})


def test_sparse_block_with_its_shared_expert_equals_transformers():
    """Qwen2-MoE's block: routed experts plus the sigmoid-gated shared expert; the stacked
    (transformers 5 in-memory) expert tensors load as they are."""
    config = _qwen2_moe_config(architectures=["Qwen2MoeForCausalLM"])
    hf_block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    _randomize(hf_block, seed=5)
    block = QwenMoeSparseBlock(_arch(config))
    hf_state = hf_block.state_dict()
    block.gate.weight.data.copy_(hf_state["gate.weight"])
    block.shared_expert_gate.weight.data.copy_(hf_state["shared_expert_gate.weight"])
    for name in ("gate_up_proj", "down_proj"):
        param = getattr(block.experts, name)
        block.experts.weight_loader(param, hf_state[f"experts.{name}"])
    shared = block.shared_expert
    for shard, name in enumerate(("gate_proj", "up_proj")):
        shared.gate_up_proj.weight_loader(
            shared.gate_up_proj.weight, hf_state[f"shared_expert.{name}.weight"], shard
        )
    shared.down_proj.weight.data.copy_(hf_state["shared_expert.down_proj.weight"])
    hidden = torch.randn(1, 21, 64)
    with torch.inference_mode():
        expected = hf_block(hidden)[0]
        out = block(hidden[0])
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
        # The shared expert contributes: without it the output is another one.
        routed = block.experts(hidden[0], *select_experts(block.gate(hidden[0]), 2, False))
    assert (routed - expected).abs().max() > 100 * ATOL


def _save_hf(config, path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


def _hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def _compare_logits(path: Path, lengths: list[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    sequences = {
        i: torch.randint(0, 320, (n,), generator=generator).tolist() for i, n in enumerate(lengths)
    }
    runner = PagedRunner(path, sequences)
    for seq_id, logits in runner.step(dict(enumerate(lengths))).items():
        diff = (logits - _hf_logits(path, sequences[seq_id])).abs().max().item()
        assert diff <= ATOL, f"seq {seq_id}: max |diff| {diff:.2e}"


def test_decoder_sparse_step_and_mlp_only_layers_equal_transformers(tmp_path):
    """4 layers, sparse every 2nd (layers 1, 3) and layer 3 dense by mlp_only_layers: only
    layer 1 is a mixture of experts."""
    config = _qwen2_moe_config(
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        architectures=["Qwen2MoeForCausalLM"],
    )
    path = _save_hf(config, tmp_path, seed=7)
    arch = load_arch_config(path)
    assert [arch.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    with torch.device("meta"):
        model = get_model_class(arch)(arch)
    assert [isinstance(layer.mlp, QwenMoeSparseBlock) for layer in model.model.layers] == [
        False,
        True,
        False,
        False,
    ]
    _compare_logits(path, [5, 19, 40])


def test_qwen3_moe_without_renormalisation_equals_transformers(tmp_path):
    config = transformers.Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=False,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        architectures=["Qwen3MoeForCausalLM"],
    )
    path = _save_hf(config, tmp_path, seed=8)
    arch = load_arch_config(path)
    assert (arch.num_experts, arch.qk_norm, arch.shared_expert_intermediate_size) == (5, True, 0)
    _compare_logits(path, [3, 30])


def test_checkpoint_names_are_per_expert_and_stacked_ones_load_alike(tiny_checkpoint, tmp_path):
    """transformers 5.25 saves one tensor per expert and matrix (as the hub's checkpoints);
    a checkpoint with transformers 5's stacked tensors loads to the same weights."""
    path = tiny_checkpoint("qwen3moe")
    tensors = load_file(path / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in tensors
    assert "model.layers.0.mlp.experts.gate_up_proj" not in tensors
    arch = load_arch_config(path)
    stacked = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(arch.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        per_expert = [
            [tensors[f"{prefix}.{e}.{part}.weight"] for e in range(arch.num_experts)]
            for part in ("gate_proj", "up_proj", "down_proj")
        ]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(per_expert[0], per_expert[1], strict=True)]
        )
        stacked[f"{prefix}.down_proj"] = torch.stack(per_expert[2])
    other = tmp_path / "stacked"
    other.mkdir()
    (other / "config.json").write_text((path / "config.json").read_text())
    save_file(stacked, other / "model.safetensors")
    one, two = (_loaded(arch, directory) for directory in (path, other))
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def _loaded(arch: ArchConfig, path: Path) -> dict[str, torch.Tensor]:
    """The parameters as loaded, before any linear method converts them."""
    with torch.device("meta"):
        model = get_model_class(arch)(arch)
    model = model.to_empty(device="cpu")
    tensors = iter_safetensors(find_weight_files(path))
    assert model.load_weights(tensors) >= model.expected_weight_names()
    return dict(model.named_parameters())


def test_a_missing_expert_tensor_is_named(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen2moe")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.down_proj.weight"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    arch = load_arch_config(tmp_path)
    with pytest.raises(ModelLoadError, match=r"experts\.5\.down_proj\.weight"):
        load_model(tmp_path, arch, dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_tensors_split_per_tensor_parallel_rank(tiny_checkpoint, rank):
    """Rank r of 2 keeps its half of every expert's gate, up (rows) and down (columns)."""
    path = tiny_checkpoint("qwen2moe")
    arch = load_arch_config(path)
    tensors = dict(iter_safetensors(find_weight_files(path)))
    parallel_state._STATE = parallel_state.TensorParallel(rank, 2)
    try:
        with torch.device("meta"):
            model = get_model_class(arch)(arch)
        model = model.to_empty(device="cpu")
        assert model.load_weights(tensors.items()) >= model.expected_weight_names()
    finally:
        parallel_state._STATE = parallel_state.TensorParallel()
    experts = model.model.layers[0].mlp.experts
    prefix = "model.layers.0.mlp.experts.4"
    gate, up = (tensors[f"{prefix}.{p}.weight"].chunk(2)[rank] for p in ("gate_proj", "up_proj"))
    assert torch.equal(experts.gate_up_proj[4], torch.cat([gate, up]))
    down = tensors[f"{prefix}.down_proj.weight"].chunk(2, dim=1)[rank]
    assert torch.equal(experts.down_proj[4], down)


def test_tp2_gives_the_greedy_tokens_of_tp1(tiny_checkpoint):
    from test_tensor_parallel import _greedy as tp_greedy
    from test_tensor_parallel import _same

    path = tiny_checkpoint("qwen2moe")
    prompts = [{"prompt_token_ids": [5, 17, 200, 3, 44]}, {"prompt_token_ids": [300, 1, 2]}]
    one, two = tp_greedy(path, prompts, 1), tp_greedy(path, prompts, 2)
    assert len(set(one["tokens"][0])) > 1
    _same(one, two)


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


@pytest.mark.parametrize("arch_name", ["qwen2moe", "qwen3moe"])
def test_greedy_generation_equals_transformers_generate(tiny_checkpoint, arch_name):
    path = tiny_checkpoint(arch_name)
    prompts = _prompts([3, 17, 32])
    expected = _hf_greedy(path, prompts, 24)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=64, profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out == ref, f"prompt {i} diverges"


def test_int8_experts_match_the_reference_on_their_dequantized_weights():
    layer = _experts(6, 32, 16, seed=9)
    dense_gate_up, dense_down = layer.gate_up_proj.clone(), layer.down_proj.clone()
    layer.prepare("int8")
    assert layer.gate_up_proj is None and layer.down_proj is None  # only the int8 copies kept
    assert all(linear.method.name == "int8" for linear in layer.experts_gate_up)
    assert layer.experts_gate_up[0].weight.dtype == torch.int8
    assert layer.experts_gate_up[0].weight_scale.shape == (32,)  # per expert and channel
    dequantized = [
        torch.stack([linear.weight.float() * linear.weight_scale[:, None] for linear in stack])
        for stack in (layer.experts_gate_up, layer.experts_down)
    ]
    assert (dequantized[0] - dense_gate_up).abs().max() <= dense_gate_up.abs().max() / 254 + 1e-6
    assert (dequantized[1] - dense_down).abs().max() <= dense_down.abs().max() / 254 + 1e-6
    for num_tokens in (1, 5, 40):  # the int8 kernel's few rows and the bfloat16 matmul's many
        hidden = torch.randn(num_tokens, 32)
        weights, ids = _routing(num_tokens, 6, 2, seed=num_tokens, renormalize=True)
        with torch.inference_mode():
            out = layer(hidden, weights, ids)
        expected = fused_moe_reference(hidden, weights, ids, *dequantized)
        # Activations rounded to bfloat16 on the way in, as every int8 matmul of qiao.
        torch.testing.assert_close(out, expected, atol=0.03, rtol=0.03)


def test_int8_model_loads_and_generates(tiny_checkpoint):
    path = tiny_checkpoint("qwen2moe")
    arch = load_arch_config(path)
    cpu = torch.device("cpu")
    int8 = load_model(path, arch, dtype=torch.float32, device=cpu, quantization="int8")
    experts = int8.model.layers[0].mlp.experts
    assert all(m.method.name == "int8" for m in [*experts.experts_gate_up, *experts.experts_down])
    assert int8.model.layers[0].mlp.gate.method.name != "int8"  # routing unquantized
    llm = LLM(str(path), quantization="int8", profile=None)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(_prompts([3, 17]), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20]


def test_bfloat16_experts_follow_float32(tiny_checkpoint):
    """bfloat16 (oneDNN matmuls on row buckets on this CPU): the sparse block's output within
    bfloat16 rounding of float32's on the same weights."""
    path = tiny_checkpoint("qwen3moe")
    arch = load_arch_config(path)
    cpu = torch.device("cpu")
    blocks = [
        load_model(path, arch, dtype=dtype, device=cpu).model.layers[0].mlp
        for dtype in (torch.float32, torch.bfloat16)
    ]
    hidden = torch.randn(37, arch.hidden_size)
    with torch.inference_mode():
        ref = blocks[0](hidden)
        out = blocks[1](hidden.bfloat16()).float()
    assert (out - ref).abs().max() <= 0.03 * ref.abs().max()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_batch_invariant_sparse_block_rows_equal_the_rows_alone(tiny_checkpoint, quantization):
    """`batch_invariant`: a token's output does not depend on the tokens beside it (which other
    tokens its experts see, how many rows each expert's matmul has), bit for bit."""
    path = tiny_checkpoint("qwen2moe")
    arch = load_arch_config(path)
    model = load_model(
        path,
        arch,
        dtype=torch.float32,
        device=torch.device("cpu"),
        quantization=quantization,
        batch_invariant=True,
    )
    block = model.model.layers[0].mlp
    assert isinstance(block, QwenMoeSparseBlock)
    hidden = torch.randn(45, arch.hidden_size)
    with torch.inference_mode():
        alone = torch.cat([block(hidden[i : i + 1]) for i in range(45)])
        for rows in (2, 7, 33, 45):
            assert torch.equal(block(hidden[:rows]), alone[:rows]), f"{rows} rows"


def test_the_sync_free_form_uses_the_experts_views_and_refuses_int8(monkeypatch):
    """Where the experts' layers compute on views of the stacks (F.linear: CUDA; here with the
    CPU's faster methods off) the form CUDA graphs capture reads the stacks; int8 copies cannot."""
    monkeypatch.setenv("QIAO_DISABLE_PACKED_LINEAR", "1")
    monkeypatch.setenv("QIAO_DISABLE_ONEDNN_LINEAR", "1")
    layer = _experts(5, 16, 8, seed=12)
    hidden = torch.randn(9, 16)
    weights, ids = _routing(9, 5, 2, seed=13, renormalize=False)
    layer.prepare(None)
    assert layer.gate_up_proj is None  # counted once, through the experts' layers
    with torch.inference_mode():
        grouped = layer(hidden, weights, ids)
        torch.testing.assert_close(layer._forward_dense(hidden, weights, ids), grouped)
    int8 = _experts(5, 16, 8, seed=12)
    int8.prepare("int8")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        int8._forward_dense(hidden, weights, ids)


def test_unsupported_expert_quantization_is_a_config_error():
    with pytest.raises(ConfigError, match=r"quantization.*mixture-of-experts"):
        _experts(2, 8, 4, seed=0).prepare("fp8")


def test_bad_moe_configs_name_the_field():
    config = _qwen2_moe_config(architectures=["Qwen2MoeForCausalLM"])
    d = {**config.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}
    with pytest.raises(ConfigError, match="num_experts_per_tok: 7"):
        ArchConfig.from_dict({**d, "num_experts_per_tok": 7})
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ArchConfig.from_dict({**d, "use_sliding_window": True})
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size: missing"):
        ArchConfig.from_dict({k: v for k, v in d.items() if k != "shared_expert_intermediate_size"})
