"""A PEFT LoRA adapter read from its folder (`adapter_config.json` + `adapter_model.safetensors`)
and mapped onto qiao's fused layers.

PEFT stores, per adapted module, `lora_A` [r, in] and `lora_B` [out, r]; the merged weight is
W + scaling * B @ A with scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). qiao fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapted `k_proj` becomes part 1 of
`qkv_proj` (its rows of the fused output). The scaling is folded into B here, once.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from qiao.errors import ConfigError
from qiao.lora.request import LoRARequest

# Checkpoint module -> (qiao's fused module, part index); None: the module is qiao's whole layer.
MODULE_PARTS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    # Phi-3 checkpoints (and their adapters) hold these fused already.
    "qkv_proj": ("qkv_proj", None),
    "gate_up_proj": ("gate_up_proj", None),
}
TARGET_MODULES = tuple(sorted({fused for fused, _ in MODULE_PARTS.values()}))
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    """An adapter on the CPU, keyed by qiao module path: part index -> (A [r, K], B [n, r])
    with the scaling folded into B (part None: the layer's whole output)."""

    request: LoRARequest
    rank: int
    weights: dict[str, dict[int | None, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    @property
    def name(self) -> str:
        return self.request.lora_name

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for parts in self.weights.values()
            for a, b in parts.values()
        )


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter folder; ConfigError naming what to fix."""
    folder = Path(request.lora_path).expanduser()
    where = f"LoRA adapter {request.lora_name!r} ({folder})"
    config = _read_config(folder, where)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise ConfigError(
            f"{where}: no adapter_model.safetensors (save the adapter with PEFT's "
            "save_pretrained and safe_serialization=True)"
        )
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
        if not module or kind not in ("A.weight", "B.weight"):
            raise ConfigError(
                f"{where}: tensor {key!r} is not a LoRA A/B weight of a linear layer (embedding "
                f"LoRA, DoRA magnitudes and trained biases are not supported)"
            )
        pairs.setdefault(module, {})[kind[0]] = tensor
    adapter = LoRAAdapter(request, rank=0)
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"{where}: {module} has lora_{''.join(pair)} only")
        parent, _, leaf = module.rpartition(".")
        if leaf not in MODULE_PARTS:
            raise ConfigError(
                f"{where}: targets {leaf!r} ({module}); qiao applies LoRA to "
                f"{', '.join(MODULE_PARTS)}"
            )
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise ConfigError(
                f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                "not [r, in] and [out, r]"
            )
        if rank > max_lora_rank:
            raise ConfigError(
                f"{where}: rank {rank} ({module}) is above max_lora_rank {max_lora_rank}; raise "
                "max_lora_rank"
            )
        alpha = float(config["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        fused, part = MODULE_PARTS[leaf]
        target = f"{parent}.{fused}" if parent else fused
        adapter.weights.setdefault(target, {})[part] = (a.float(), b.float() * scaling)
        adapter.rank = max(adapter.rank, rank)
    if not adapter.weights:
        raise ConfigError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return adapter


def _read_config(folder: Path, where: str) -> dict:
    path = folder / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no adapter_config.json (not a PEFT adapter folder)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: adapter_config.json cannot be read ({exc})") from None
    unsupported = {
        "use_dora": "DoRA",
        "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
        "modules_to_save": "fully trained modules (modules_to_save)",
        "fan_in_fan_out": "fan_in_fan_out weights",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise ConfigError(f"{where}: {what} is not supported")
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type {config['peft_type']!r}; only LORA is supported")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{where}: bias {config['bias']!r}; only adapters with bias 'none'")
    if "lora_alpha" not in config:
        raise ConfigError(f"{where}: adapter_config.json has no lora_alpha")
    return config
