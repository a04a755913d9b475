"""Multi-LoRA serving: PEFT adapters on a fixed pool of device slots, chosen per request and
computed grouped by adapter in one step (docs/lora.md)."""

from qiao.lora.request import LoRARequest

__all__ = ["LoRARequest"]
