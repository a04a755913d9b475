"""Forward-pass FLOPs of a decoder-only transformer, from its `ArchConfig`.

Counted: every weight matmul (2 FLOPs per multiply-add), attention's QK^T and PV over the
context, and the lm_head for tokens whose logits are computed. Not counted: norms, RoPE,
activations, biases, softmax and the embedding lookup (all O(hidden) per token, under 1 % here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qiao.models.arch_config import ArchConfig


def linear_params_per_layer(arch: ArchConfig) -> int:
    """Weights each token multiplies through in one layer: q, k, v, o, gate, up, down."""
    h, d = arch.hidden_size, arch.head_dim
    q_out = arch.num_attention_heads * d
    kv_out = arch.num_key_value_heads * d
    attention = h * q_out + 2 * h * kv_out + q_out * h
    mlp = 3 * h * arch.intermediate_size
    return attention + mlp


def attention_flops(arch: ArchConfig, context_len: int) -> int:
    """QK^T and PV of one token attending to `context_len` keys (itself included), all layers."""
    keys = min(context_len, arch.sliding_window or context_len)
    # Per layer and key: a head_dim dot product for the score and a head_dim axpy for the value.
    return 4 * arch.num_attention_heads * arch.head_dim * keys * arch.num_hidden_layers


def token_flops(arch: ArchConfig, context_len: int, compute_logits: bool) -> int:
    """Forward FLOPs of one token at context length `context_len` (its position + 1)."""
    flops = 2 * linear_params_per_layer(arch) * arch.num_hidden_layers
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
    linear = 2 * linear_params_per_layer(arch) * arch.num_hidden_layers * num_fed
    attention = attention_flops(arch, 1) * _sum_of_keys(num_fed, arch.sliding_window)
    logits = 2 * arch.hidden_size * arch.vocab_size * num_output_tokens
    return linear + attention + logits


def _sum_of_keys(num_tokens: int, window: int | None) -> int:
    """sum over context lengths c = 1..num_tokens of min(c, window)."""
    if window is None or num_tokens <= window:
        return num_tokens * (num_tokens + 1) // 2
    return window * (window + 1) // 2 + (num_tokens - window) * window
