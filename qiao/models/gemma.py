"""The Gemma family, text only: Gemma 2 and Gemma 3 as constructor flags of one model.

Beside Llama: RMSNorm scales by (1 + w) in float32, the embedding is scaled by sqrt(hidden_size)
(in the model's dtype), a tanh-GELU gate, norms after attention and after the MLP as well as
before them, the attention scale `query_pre_attn_scalar ** -0.5`, and per-layer windows: a layer
is `sliding_attention` or `full_attention` (`ArchConfig.layer_types`).
Gemma 2: the attention scores and the final logits are soft-capped, `cap * tanh(x / cap)`.
Gemma 3: per-head q/k norms before RoPE, and sliding layers rotate with their own RoPE base.
Parameter names follow Hugging Face; q/k/v and gate/up are fused as in Llama, which also loads
the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from qiao.attention.metadata import AttentionMetadata
from qiao.distributed.parallel_state import divide
from qiao.layers.activation import GeluTanhAndMul
from qiao.layers.attention import Attention
from qiao.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qiao.layers.layernorm import RMSNorm
from qiao.layers.linear import QKVLinear, RowParallelLinear
from qiao.layers.rotary import RotaryEmbedding, apply_rotary
from qiao.models.arch_config import ArchConfig
from qiao.models.llama import LlamaForCausalLM, LlamaMLP

# (cos, sin) of the step's positions, by layer type.
RopeTables = dict[str, tuple[torch.Tensor, torch.Tensor]]


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with Gemma's (1 + w) scale, applied in float32 before the cast back (Hugging
    Face's order; the checkpoint stores w, zero-centred). Plain PyTorch, no kernel."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._reference(x)
        residual = x + residual
        return self._reference(residual), residual

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = divide(arch.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = divide(arch.num_key_value_heads, "num_key_value_heads")
        self.head_dim = arch.head_dim
        self.layer_type = (
            "sliding_attention"
            if arch.layer_sliding_window(layer_index) is not None
            else "full_attention"
        )
        self.qkv_proj = QKVLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * self.head_dim, arch.hidden_size, arch.attention_bias
        )
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=arch.query_pre_attn_scalar**-0.5,
            sliding_window=arch.layer_sliding_window(layer_index),
            softcap=arch.attn_logit_softcapping,
        )

    def forward(
        self, hidden: torch.Tensor, rope: RopeTables, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[self.layer_type]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, metadata))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(arch, layer_index)
        self.mlp = LlamaMLP(arch, GeluTanhAndMul())  # Llama's MLP with a tanh-GELU gate
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeTables,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's normed MLP output, the residual stream before it).

        As in Llama the residual add is deferred into the next norm: the stream after layer i is
        `hidden + residual` of its outputs.
        """
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(arch, i) for i in range(arch.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.embed_scale = arch.hidden_size**0.5
        self.rotary_emb = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)
        # Gemma 3's sliding layers: their own base, no scaling. Gemma 2: the global table.
        self.rotary_emb_local = (
            RotaryEmbedding(arch.rotary_dim, arch.rope_local_theta)
            if arch.rope_local_theta is not None
            else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale rounds to the model's dtype first, as in Hugging Face.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        full = self.rotary_emb(positions, hidden.dtype)
        local = (
            full
            if self.rotary_emb_local is None
            else self.rotary_emb_local(positions, hidden.dtype)
        )
        rope = {"full_attention": full, "sliding_attention": local}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, metadata)
        return self.norm(hidden, residual)[0]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 (text). Weight loading, KV binding and tying as in Llama."""

    def __init__(self, arch: ArchConfig) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        self.model = GemmaModel(arch)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        self.tie_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size], soft-capped in float32 where the config says
        (else in the weights' dtype, as `ParallelLMHead`)."""
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: soft-capped attention and logits, every other layer sliding."""


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 text (`gemma3_text`): q/k norms, a local RoPE base, `layer_types` windows."""
