"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and Phi-3 as constructor flags of one model.

Variants: q/k/v bias (Qwen2; also o_proj for Llama's `attention_bias`), per-head q/k RMSNorm
before RoPE (Qwen3), tied embeddings, a sliding window (Mistral, Phi-3), scaled RoPE (Llama 3.1,
LongRoPE for Phi-3 / Phi-4-mini), partial rotary (Phi-4-mini).
Parameter names follow Hugging Face, except that q/k/v and gate/up are fused (`_PACKED`); Phi-3
checkpoints hold them fused already (`fused_checkpoint`), under the same names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from qiao.attention.metadata import AttentionMetadata
from qiao.distributed.parallel_state import divide
from qiao.errors import ModelLoadError
from qiao.layers.activation import SiluAndMul
from qiao.layers.attention import Attention
from qiao.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qiao.layers.int4_checkpoint import Int4CheckpointReader
from qiao.layers.layernorm import RMSNorm
from qiao.layers.linear import (
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    default_weight_loader,
)
from qiao.layers.rotary import RotaryEmbedding, apply_rotary
from qiao.models.arch_config import ArchConfig

# fused module -> (checkpoint module, shard id) of each part, in order.
_PACKED: dict[str, tuple[tuple[str, str | int], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
}
_SHARD_OF = {part: (fused, shard) for fused, parts in _PACKED.items() for part, shard in parts}


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = divide(arch.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = divide(arch.num_key_value_heads, "num_key_value_heads")
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.attention_bias,
        )
        # Qwen2 (and Qwen2-MoE) bias q/k/v but not o.
        o_bias = arch.attention_bias and arch.architecture not in (
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
        )
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * self.head_dim, arch.hidden_size, o_bias
        )
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.qk_norm = arch.qk_norm
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=self.head_dim**-0.5,
            sliding_window=arch.sliding_window,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(self.attn(q.flatten(1), k.flatten(1), v, metadata))


class LlamaMLP(nn.Module):
    """gate_up -> gated activation (SiLU, or the family's own) -> down."""

    def __init__(self, arch: ArchConfig, act_fn: nn.Module | None = None) -> None:
        super().__init__()
        size = arch.intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, [size, size], arch.mlp_bias)
        self.act_fn = act_fn if act_fn is not None else SiluAndMul()
        self.down_proj = RowParallelLinear(size, arch.hidden_size, arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (this layer's MLP output, the residual stream before it).

        The residual add is deferred into the next norm (one fused pass), so the stream after
        layer i is `hidden + residual` of its outputs.
        """
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, metadata)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tied: the head shares model.embed_tokens.weight; the checkpoint's lm_head is ignored.

        Called again after the model moves off the meta device (which unties shared tensors).
        """
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] in the weights' dtype (`ParallelLMHead`)."""
        return self.lm_head(hidden)

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        """One cache per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        if len(caches) != len(self.model.layers):
            raise ValueError(f"{len(caches)} KV caches for {len(self.model.layers)} layers")
        for layer, cache in zip(self.model.layers, caches, strict=True):
            layer.self_attn.attn.kv_cache = cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) in; returns the names consumed."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        fmt = self.arch.quantization_config  # AWQ / GPTQ: int4 tensors go to the reader
        int4 = Int4CheckpointReader(fmt) if fmt is not None else None
        for name, tensor in weights:
            if int4 is not None and int4.take(name, tensor):
                continue
            if name.endswith("rotary_emb.inv_freq") or (
                self.arch.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            param_name, shard_id = _param_name(name)
            if param_name not in params:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has no parameter in {self.arch.architecture}"
                )
            module = self.get_submodule(param_name.rpartition(".")[0])
            weight_loader = getattr(module, "weight_loader", default_weight_loader)
            try:
                weight_loader(params[param_name], tensor, shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
            loaded.add(name)
        if int4 is not None:
            loaded |= int4.attach(self, self._linear_of)
        return loaded

    def _linear_of(self, name: str) -> tuple[nn.Module, str | int | None]:
        """The layer and shard id a checkpoint weight name loads into."""
        param_name, shard_id = _param_name(name)
        try:
            return self.get_submodule(param_name.rpartition(".")[0]), shard_id
        except AttributeError:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has no layer in {self.arch.architecture}"
            ) from None

    def expected_weight_names(self) -> set[str]:
        """The checkpoint tensor names `load_weights` needs to fill every parameter."""
        names = set()
        packed = {} if self.arch.fused_checkpoint else _PACKED
        for param_name, _ in self.named_parameters():
            module_path, _, leaf = param_name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            prefix = f"{parent}." if parent else ""
            parts = packed.get(module, ((module, None),))
            names.update(f"{prefix}{part}.{leaf}" for part, _ in parts)
        return names


def _param_name(name: str) -> tuple[str, str | int | None]:
    """Checkpoint name -> (parameter name, shard id).

    E.g. "model.layers.0.self_attn.k_proj.weight" -> ("model.layers.0.self_attn.qkv_proj.weight",
    "k"); other names map to themselves with shard id None, a fused checkpoint's
    "...qkv_proj.weight" too (the fused layer splits it).
    """
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    if module not in _SHARD_OF:
        return name, None
    fused, shard_id = _SHARD_OF[module]
    return f"{parent}.{fused}.{leaf}", shard_id
