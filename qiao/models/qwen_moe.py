"""The Qwen mixture-of-experts family: Qwen2-MoE and Qwen3-MoE, the Llama family's attention and
decoder layer with a sparse MLP.

Qwen2-MoE: q/k/v bias, and beside the routed experts a shared expert (a dense MLP of
`shared_expert_intermediate_size`) scaled by a sigmoid gate. Qwen3-MoE: per-head q/k RMSNorm, no
shared expert. Both: `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok`
chosen per token (`norm_topk_prob`: their weights renormalised); layer i is sparse when
(i + 1) % `decoder_sparse_step` == 0 and i is not in `mlp_only_layers`, else a dense Llama MLP of
`intermediate_size`. The experts run as one `FusedMoE` layer (qiao/layers/fused_moe.py).

Parameter names follow Hugging Face (the Llama family's fused q/k/v and gate/up aside); the
experts' are transformers 5's stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`,
loaded from the per-expert checkpoint tensors (`mlp.experts.{e}.gate_proj.weight`, ...) or the
stacked ones.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from qiao.errors import ModelLoadError
from qiao.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from qiao.layers.fused_moe import (
    EXPERT_PARTS,
    FusedMoE,
    RouterLinear,
    expert_shard,
    select_experts,
)
from qiao.layers.layernorm import RMSNorm
from qiao.layers.rotary import RotaryEmbedding
from qiao.models.arch_config import ArchConfig
from qiao.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# E.g. "model.layers.3.mlp.experts.7.up_proj.weight" -> ("model.layers.3.mlp.experts", "7",
# "up_proj").
_PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# E.g. "model.layers.3.mlp.experts.gate_up_proj" (transformers 5's stacked tensors).
_STACKED = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


class QwenMoeSparseBlock(nn.Module):
    """Router (`gate`), routed experts and, for Qwen2-MoE, the gated shared expert."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.renormalize = arch.norm_topk_prob
        self.gate = RouterLinear(arch.hidden_size, arch.num_experts)
        self.experts = FusedMoE(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        self.shared_expert: LlamaMLP | None = None
        if arch.shared_expert_intermediate_size:
            shared = dataclasses.replace(
                arch, intermediate_size=arch.shared_expert_intermediate_size, mlp_bias=False
            )
            self.shared_expert = LlamaMLP(shared)
            self.shared_expert_gate = RouterLinear(arch.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, self.renormalize)
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is None:
            return out
        return out + _sigmoid_per_row(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)


# Floats per row that keep a [T, 1] sigmoid on torch's vectorised path for every row.
_VECTOR_WIDTH = 32


def _sigmoid_per_row(logits: torch.Tensor) -> torch.Tensor:
    """sigmoid of [T, 1], each row rounded alike whatever T (batch invariance): torch's CPU
    kernel runs whole vectors (32 floats on AVX-512) and a scalar tail that rounds differently,
    so a token in a [T, 1] tensor would get either by its place; in rows of 32 copies every row
    is vectors."""
    return torch.sigmoid(logits.expand(-1, _VECTOR_WIDTH).contiguous())[:, :1]


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is sparse where `arch.is_sparse_layer(layer_index)`."""

    def __init__(self, arch: ArchConfig, layer_index: int) -> None:
        super().__init__(arch)
        if arch.is_sparse_layer(layer_index):
            self.mlp = QwenMoeSparseBlock(arch)  # in place of the dense MLP (meta: no memory)


class QwenMoeModel(LlamaModel):
    def __init__(self, arch: ArchConfig) -> None:
        nn.Module.__init__(self)  # LlamaModel's parts, with this family's layers
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            QwenMoeDecoderLayer(arch, i) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_scaling)


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE and Qwen3-MoE; the variant is read from `arch` (see the module docstring)."""

    def __init__(self, arch: ArchConfig) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM's parts, with this family's model
        self.arch = arch
        self.model = QwenMoeModel(arch)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size)
        self.tie_weights()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the Llama family's, the experts' tensors first: a stacked tensor counts as every
        per-expert name it holds (`expected_weight_names` asks for those)."""
        loaded: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if (match := _PER_EXPERT.fullmatch(name)) is not None:
                    experts_path, expert, part = match.groups()
                    param_name, part_id = expert_shard(part)
                    self._load_experts(experts_path, param_name, tensor, (int(expert), part_id))
                    loaded.add(name)
                elif (match := _STACKED.fullmatch(name)) is not None:
                    experts_path, param_name = match.groups()
                    self._load_experts(experts_path, param_name, tensor, None)
                    loaded.update(self._per_expert_names(experts_path, param_name))
                else:
                    yield name, tensor

        rest = super().load_weights(others())  # fills `loaded` as it goes
        return loaded | rest

    def _load_experts(self, experts_path: str, param_name: str, tensor, shard_id) -> None:
        try:
            experts = self.get_submodule(experts_path)
        except AttributeError:
            experts = None
        if not isinstance(experts, FusedMoE):
            raise ModelLoadError(
                f"checkpoint tensor {experts_path}.{param_name}: no expert layer there in "
                f"{self.arch.architecture} (a dense layer? see mlp_only_layers)"
            )
        try:
            experts.weight_loader(getattr(experts, param_name), tensor, shard_id)
        except ModelLoadError as e:
            raise ModelLoadError(
                f"checkpoint tensor of {experts_path} ({param_name}): {e}"
            ) from None

    def _per_expert_names(self, experts_path: str, param_name: str) -> set[str]:
        parts = [p for p in EXPERT_PARTS if expert_shard(p)[0] == param_name]
        return {
            f"{experts_path}.{e}.{part}.weight"
            for e in range(self.arch.num_experts)
            for part in parts
        }

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name in super().expected_weight_names():
            if (match := _STACKED.fullmatch(name)) is not None:
                names.update(self._per_expert_names(*match.groups()))
            else:
                names.add(name)
        return names


# The registry's names; one class, the variant read from the config.
Qwen2MoeForCausalLM = QwenMoeForCausalLM
Qwen3MoeForCausalLM = QwenMoeForCausalLM
