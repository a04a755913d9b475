"""Forward-pass FLOPs of a decoder-only transformer, from its `ArchConfig`.

Counted: every weight matmul (2 FLOPs per multiply-add), attention's QK^T and PV over the
context, and the lm_head for tokens whose logits are computed. Not counted: norms, RoPE,
activations, biases, softmax and the embedding lookup (all O(hidden) per token, under 1 % here).

Layers are counted one by one: a mixture-of-experts layer's MLP is the router, the
`num_experts_per_tok` experts a token runs through and the shared expert (dense layers, by
`ArchConfig.is_sparse_layer`, are a dense MLP), and each layer's attention sees the keys of its
own window (`ArchConfig.layer_sliding_window`: Gemma's sliding and global layers, Mistral's
window on every layer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qiao.models.arch_config import ArchConfig


def linear_params_per_layer(arch: ArchConfig, layer_index: int) -> int:
    """Weights each token multiplies through in layer `layer_index`: q, k, v, o, and gate, up,
    down of its MLP, or of a sparse layer the router, the top-k experts and the shared expert
    with its gate."""
    h, d = arch.hidden_size, arch.head_dim
    q_out = arch.num_attention_heads * d
    kv_out = arch.num_key_value_heads * d
    attention = h * q_out + 2 * h * kv_out + q_out * h
    return attention + _mlp_params_per_token(arch, layer_index)


def _mlp_params_per_token(arch: ArchConfig, layer_index: int) -> int:
    h = arch.hidden_size
    if not arch.is_sparse_layer(layer_index):
        return 3 * h * arch.intermediate_size
    router = h * arch.num_experts
    experts = arch.num_experts_per_tok * 3 * h * arch.moe_intermediate_size
    shared = 0
    if arch.shared_expert_intermediate_size:
        shared = 3 * h * arch.shared_expert_intermediate_size + h  # + its [1, h] gate
    return router + experts + shared


def linear_params_per_token(arch: ArchConfig) -> int:
    """Weights one token multiplies through in all layers (the lm_head aside)."""
    return sum(linear_params_per_layer(arch, i) for i in range(arch.num_hidden_layers))


def attention_flops(arch: ArchConfig, context_len: int) -> int:
    """QK^T and PV of one token attending to `context_len` keys (itself included), all layers,
    each layer's keys capped at its own sliding window."""
    keys = sum(
        min(context_len, arch.layer_sliding_window(i) or context_len)
        for i in range(arch.num_hidden_layers)
    )
    return _attention_flops_per_key(arch) * keys


def _attention_flops_per_key(arch: ArchConfig) -> int:
    """One layer, one key: a head_dim dot product for the score and a head_dim axpy for the
    value, per query head."""
    return 4 * arch.num_attention_heads * arch.head_dim


def token_flops(arch: ArchConfig, context_len: int, compute_logits: bool) -> int:
    """Forward FLOPs of one token at context length `context_len` (its position + 1)."""
    flops = 2 * linear_params_per_token(arch)
    flops += attention_flops(arch, context_len)
    if compute_logits:
        flops += 2 * arch.hidden_size * arch.vocab_size
    return flops


def sequence_flops(arch: ArchConfig, num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Forward FLOPs to generate `num_output_tokens` after a `num_prompt_tokens` prompt.

    The model runs on the prompt and then on every output token but the last (E.g. prompt 3,
    output 2 -> it runs on 4 tokens at context lengths 1..4), and computes logits once per
    output token: at the last prompt token and at each decode input. Prefix-cache hits are
    counted as computed: this is the model's work, not the work the engine skipped.
    """
    num_fed = num_prompt_tokens + max(num_output_tokens - 1, 0)
    linear = 2 * linear_params_per_token(arch) * num_fed
    keys = sum(
        _sum_of_keys(num_fed, arch.layer_sliding_window(i)) for i in range(arch.num_hidden_layers)
    )
    attention = _attention_flops_per_key(arch) * keys
    logits = 2 * arch.hidden_size * arch.vocab_size * num_output_tokens
    return linear + attention + logits


def _sum_of_keys(num_tokens: int, window: int | None) -> int:
    """sum over context lengths c = 1..num_tokens of min(c, window)."""
    if window is None or num_tokens <= window:
        return num_tokens * (num_tokens + 1) // 2
    return window * (window + 1) // 2 + (num_tokens - window) * window
