"""Model classes by architecture name (config.json `architectures`), imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from qiao.models.arch_config import ArchConfig

# architecture -> (module, class). Mistral, Qwen2/3 and Phi-3 are Llama with constructor flags.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("qiao.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("qiao.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qiao.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qiao.models.llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("qiao.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("qiao.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qiao.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("qiao.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("qiao.models.gemma", "Gemma3ForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def get_model_class(arch: ArchConfig) -> type[nn.Module]:
    module_name, class_name = _MODELS[arch.architecture]
    return getattr(importlib.import_module(module_name), class_name)
