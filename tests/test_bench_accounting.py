"""The benchmarks' accounting against hand counts on tiny configs: FLOPs per layer (Gemma's
sliding and global layers, Qwen2's and Mistral's windows, mixture-of-experts MLPs) and the
weight bytes a decode step reads (the experts its tokens route to). Dense Llama figures are
the plain formula's."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from qiao.bench.common import weight_bytes_per_decode_step
from qiao.bench.flops import sequence_flops, token_flops
from qiao.bench.shapes import shape_config
from qiao.layers.fused_moe import prepare_experts
from qiao.models.arch_config import ArchConfig
from qiao.models.llama import LlamaForCausalLM
from qiao.models.qwen_moe import QwenMoeForCausalLM

# Every config below: hidden 8, 2 heads of 4 over 1 KV head, vocab 10. Per layer the attention
# weights are q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, a dense MLP of 16 is 3 x 8x16 = 384, and
# each key costs 4 x heads x head_dim = 32 FLOPs (QK^T + PV).
_SMALL = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "vocab_size": 10,
}
_ATTENTION, _DENSE_MLP, _PER_KEY, _LM_HEAD = 192, 384, 32, 2 * 8 * 10


def _arch(architecture: str, **fields: Any) -> ArchConfig:
    return ArchConfig.from_dict({"architectures": [architecture], **_SMALL, **fields})


def _gemma2(**fields: Any) -> ArchConfig:
    return _arch("Gemma2ForCausalLM", hidden_activation="gelu_pytorch_tanh", **fields)


# --- FLOPs: each layer's own window -----------------------------------------------------------


def test_gemma2_flops_window_only_its_sliding_layers() -> None:
    """2 layers, window 4: layer 0 slides, layer 1 sees everything (Gemma 2 alternates)."""
    arch = _gemma2(sliding_window=4)
    linear = 2 * (_ATTENTION + _DENSE_MLP) * 2
    # Context 10: min(10, 4) keys in layer 0, 10 in layer 1.
    assert token_flops(arch, 10, compute_logits=False) == linear + (4 + 10) * _PER_KEY
    assert token_flops(arch, 3, compute_logits=True) == linear + (3 + 3) * _PER_KEY + _LM_HEAD
    # Prompt 6, output 1: contexts 1..6, layer 0 capped at 4, logits once.
    layer_0 = 1 + 2 + 3 + 4 + 4 + 4
    layer_1 = 1 + 2 + 3 + 4 + 5 + 6
    expected = 6 * linear + (layer_0 + layer_1) * _PER_KEY + _LM_HEAD
    assert sequence_flops(arch, 6, 1) == expected


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        # transformers 4: one global layer in every `sliding_window_pattern`.
        ({"sliding_window_pattern": 3, "num_hidden_layers": 3}, (2, 2, None)),
        # transformers 5: `layer_types` as written.
        ({"layer_types": ["full_attention", "sliding_attention"]}, (None, 2)),
    ],
)
def test_gemma3_flops_follow_its_layer_types(
    fields: dict[str, Any], windows: tuple[int | None, ...]
) -> None:
    arch = _arch(
        "Gemma3ForCausalLM", hidden_activation="gelu_pytorch_tanh", sliding_window=2, **fields
    )
    linear = 2 * (_ATTENTION + _DENSE_MLP) * len(windows)
    keys = sum(min(5, w or 5) for w in windows)
    assert token_flops(arch, 5, compute_logits=False) == linear + keys * _PER_KEY
    # Contexts 1..3: a window-2 layer sees 1 + 2 + 2 keys, a global one 1 + 2 + 3.
    keys = sum(5 if w else 6 for w in windows)
    assert sequence_flops(arch, 3, 1) == 3 * linear + keys * _PER_KEY + _LM_HEAD


@pytest.mark.parametrize(
    ("architecture", "fields", "window"),
    [
        ("MistralForCausalLM", {"sliding_window": 3}, 3),
        # Qwen2 slides only with use_sliding_window, from layer max_window_layers on.
        ("Qwen2ForCausalLM", {"sliding_window": 3, "use_sliding_window": False}, None),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 3, "use_sliding_window": True, "max_window_layers": 0},
            3,
        ),
    ],
)
def test_one_window_on_every_layer_or_none(
    architecture: str, fields: dict[str, Any], window: int | None
) -> None:
    arch = _arch(architecture, **fields)
    linear = 2 * (_ATTENTION + _DENSE_MLP) * 2
    keys = 2 * min(7, window or 7)
    assert token_flops(arch, 7, compute_logits=False) == linear + keys * _PER_KEY


def test_dense_llama_flops_are_the_plain_formula() -> None:
    """A real shape: every layer q, k, v, o, gate, up, down; every layer sees every key."""
    arch = ArchConfig.from_dict(shape_config("llama-3.2-1b"))
    h, d, layers = arch.hidden_size, arch.head_dim, arch.num_hidden_layers
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * arch.intermediate_size
    per_key = 4 * arch.num_attention_heads * d * layers
    lm_head = 2 * h * arch.vocab_size
    assert token_flops(arch, 100, True) == 2 * per_layer * layers + 100 * per_key + lm_head
    expected = 9 * 2 * per_layer * layers + 45 * per_key + 2 * lm_head  # contexts 1..9
    assert sequence_flops(arch, 8, 2) == expected


# --- FLOPs: mixture-of-experts layers ---------------------------------------------------------

# 4 experts of 4, 2 per token; Qwen2-MoE's shared expert of 12. Layer 0 dense, layer 1 sparse.
_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 4,
    "shared_expert_intermediate_size": 12,
}
_ROUTER = 8 * 4
_TOP_K_EXPERTS = 2 * 3 * 8 * 4
_SHARED = 3 * 8 * 12 + 8  # its MLP and its [1, 8] gate


@pytest.mark.parametrize(
    "dense_layer_0", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}], ids=str
)
def test_qwen2_moe_flops_count_the_experts_a_token_runs(dense_layer_0: dict[str, Any]) -> None:
    arch = _arch("Qwen2MoeForCausalLM", **_MOE, **dense_layer_0)
    dense = _ATTENTION + _DENSE_MLP
    sparse = _ATTENTION + _ROUTER + _TOP_K_EXPERTS + _SHARED
    linear = 2 * (dense + sparse)
    assert token_flops(arch, 2, compute_logits=True) == linear + 2 * 2 * _PER_KEY + _LM_HEAD
    assert sequence_flops(arch, 2, 1) == 2 * linear + 2 * (1 + 2) * _PER_KEY + _LM_HEAD


def test_qwen3_moe_flops_have_no_shared_expert() -> None:
    arch = _arch("Qwen3MoeForCausalLM", **_MOE, mlp_only_layers=[0])
    linear = 2 * ((_ATTENTION + _DENSE_MLP) + (_ATTENTION + _ROUTER + _TOP_K_EXPERTS))
    assert token_flops(arch, 1, compute_logits=False) == linear + 2 * _PER_KEY


# --- Weight bytes per decode step -------------------------------------------------------------

# The tiny Qwen2-MoE model in float32, by hand (parameters): per layer q/k/v 16x8 + their bias
# 16, o 8x8, two norms of 8 -> 224; layer 0's dense MLP gate/up 32x8 + down 8x16 = 384; layer
# 1's router 4x8, shared expert 24x8 + 8x12 and its gate 1x8 -> 328; the final norm 8; the
# lm_head 10x8 (untied). The embedding is a lookup. Layer 1's 4 experts: 4 x (8x8 + 8x4) = 384.
_MOE_SHARED_BYTES = 4 * (2 * 224 + 384 + 328 + 8 + 80)
_MOE_EXPERT_BYTES = 4 * 384


def _mean_distinct_experts(num_experts: int, top_k: int, num_seqs: int) -> float:
    """The mean count of distinct experts over every way `num_seqs` tokens pick top_k of
    num_experts, each way equally likely (uniform routing), by enumeration."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    ways = list(itertools.product(choices, repeat=num_seqs))
    return sum(len(set(itertools.chain(*way))) for way in ways) / len(ways)


@pytest.mark.parametrize("num_seqs", [1, 2, 3])
def test_decode_bytes_read_the_shared_weights_and_the_experts_hit(num_seqs: int) -> None:
    model = QwenMoeForCausalLM(_arch("Qwen2MoeForCausalLM", **_MOE, mlp_only_layers=[0]))
    hit = _mean_distinct_experts(4, 2, num_seqs)  # 2, 3, 3.5
    expected = _MOE_SHARED_BYTES + round(_MOE_EXPERT_BYTES * hit / 4)
    assert weight_bytes_per_decode_step(model, num_seqs) == expected


def test_decode_bytes_of_many_sequences_approach_every_expert() -> None:
    model = QwenMoeForCausalLM(_arch("Qwen2MoeForCausalLM", **_MOE, mlp_only_layers=[0]))
    every_expert = _MOE_SHARED_BYTES + _MOE_EXPERT_BYTES
    assert weight_bytes_per_decode_step(model, 64) == every_expert  # 1 - 2**-64 rounds to 1
    top_k_is_every_expert = {**_MOE, "num_experts_per_tok": 4}
    model = QwenMoeForCausalLM(
        _arch("Qwen2MoeForCausalLM", **top_k_is_every_expert, mlp_only_layers=[0])
    )
    assert weight_bytes_per_decode_step(model) == every_expert


def test_int8_expert_bytes_scale_with_the_experts_hit() -> None:
    """Prepared int8 experts: each reads its int8 matrices and float32 scales, not the bfloat16
    copies: per expert gate_up 8x8 + 8 x 4 and down 8x4 + 8 x 4 = 160 bytes, 4 experts."""
    model = QwenMoeForCausalLM(_arch("Qwen2MoeForCausalLM", **_MOE, mlp_only_layers=[0]))
    prepare_experts(model, quantization="int8", batch_hint=128)
    experts = 4 * 160
    one, three = (weight_bytes_per_decode_step(model, n) for n in (1, 3))
    assert three - one == experts * (3.5 - 2) / 4  # the expected experts hit: 2 at 1, 3.5 at 3


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_dense_llama_decode_bytes_are_every_weight_at_any_batch(tie_word_embeddings: bool) -> None:
    """Per layer q/k/v 16x8, o 8x8, two norms of 8, gate/up 32x8 and down 8x16 -> 592; the
    final norm 8; the lm_head 10x8 read whole, tied or not."""
    arch = _arch("LlamaForCausalLM", tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(arch)
    expected = 4 * (2 * 592 + 8 + 80)
    assert weight_bytes_per_decode_step(model) == expected
    assert weight_bytes_per_decode_step(model, 32) == expected


def test_decode_bytes_need_a_sequence() -> None:
    model = LlamaForCausalLM(_arch("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="num_seqs"):
        weight_bytes_per_decode_step(model, 0)


def test_expected_experts_hit_matches_the_closed_form() -> None:
    """The enumeration above is the reference; E (1 - (1 - k/E)^B) is what the docstring says."""
    for num_experts, top_k, num_seqs in [(4, 2, 3), (5, 1, 2), (6, 3, 2)]:
        closed = num_experts * (1 - (1 - top_k / num_experts) ** num_seqs)
        assert math.isclose(_mean_distinct_experts(num_experts, top_k, num_seqs), closed)
