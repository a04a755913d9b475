"""`LoRAManager`: the runner's adapters: registered names, a CPU cache, and the device slots.

- Registered adapters (`add`): name -> `LoRARequest`; a registered adapter can always be loaded
  again from its folder.
- CPU cache: up to `max_cpu_loras` loaded adapters (`LoRAAdapter`), least recently used dropped.
- Device slots 1..`max_loras` of every LoRA-enabled layer (`LoRASlots`), slot 0 being "no
  adapter". `step` gives each adapter of the step a slot, evicting the least recently used
  adapter that this step does not use. The runner splits a step with more adapters than slots
  into parts (`split`), so every step fits.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from qiao.errors import ConfigError, ModelNotFoundError
from qiao.lora.adapter import TARGET_MODULES, LoRAAdapter, load_adapter
from qiao.lora.request import LoRARequest
from qiao.lora.slots import LoRAContext, LoRASlots, build_plan

if TYPE_CHECKING:
    from qiao.config import LoRAConfig

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Give every target layer of `model` (a module with a `lora` attribute named one of
        `TARGET_MODULES`) its slots."""
        self.config = config
        self.device = device
        self.context = LoRAContext()
        self.layers: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            if name.rpartition(".")[2] not in TARGET_MODULES or not hasattr(module, "lora"):
                continue
            parts = getattr(module, "split_sizes", None) or getattr(module, "output_sizes", None)
            module.lora = LoRASlots(
                self.context,
                input_size=module.input_size,
                part_sizes=list(parts or [module.output_size]),
                num_slots=config.max_loras + 1,
                max_lora_rank=config.max_lora_rank,
                dtype=dtype,
                device=device,
            )
            self.layers[name] = module.lora
        self.registered: dict[str, LoRARequest] = {}
        # Keyed by the request (name, id and folder), not the name: a request running under an
        # adapter that was replaced or removed meanwhile finishes under the one it started with.
        self.cpu_cache: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        # Least recently used first.
        self.slots: OrderedDict[LoRARequest, int] = OrderedDict()
        self.free_slots = list(range(config.max_loras, 0, -1))
        self.num_slot_loads = 0
        self.num_slot_evictions = 0

    def add(self, request: LoRARequest) -> bool:
        """Register an adapter (loaded and checked now, into the CPU cache); False when the same
        request was registered already. A new request under a known name replaces it."""
        known = self.registered.get(request.lora_name)
        if known == request:
            return False
        adapter = load_adapter(request, self.config.max_lora_rank)
        self._check_targets(adapter)
        if known is not None:
            self.remove(request.lora_name)
        self.registered[request.lora_name] = request
        self._cache(adapter)
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %d layers)",
            request.lora_name,
            request.lora_path,
            adapter.rank,
            len(adapter.weights),
        )
        return True

    def remove(self, name: str) -> None:
        """Forget an adapter (ModelNotFoundError when it is not registered): new requests can
        no longer name it; one still running reloads it from its folder if it has to."""
        request = self.registered.pop(name, None)
        if request is None:
            raise ModelNotFoundError(f"LoRA adapter {name!r} is not loaded")
        self.cpu_cache.pop(request, None)
        slot = self.slots.pop(request, None)
        if slot is not None:
            self._write_slot(slot, None)
            self.free_slots.append(slot)

    def slot_bytes(self) -> int:
        """Device memory of every layer's slots."""
        return sum(
            t.numel() * t.element_size()
            for layer in self.layers.values()
            for t in (layer.lora_a, layer.lora_b)
        )

    def split(self, loras: Sequence[LoRARequest | None]) -> list[list[int]] | None:
        """Row indices of a step's parts, each with at most `max_loras` adapters; None when
        the step fits whole. E.g. max_loras 1, adapters [a, None, b, a] -> [[0, 1, 3], [2]]."""
        distinct = list(dict.fromkeys(n for n in loras if n is not None))
        limit = self.config.max_loras
        if len(distinct) <= limit:
            return None
        part_of = {lora: i // limit for i, lora in enumerate(distinct)}
        parts: list[list[int]] = [[] for _ in range(-(-len(distinct) // limit))]
        for row, lora in enumerate(loras):
            parts[part_of[lora] if lora is not None else 0].append(row)
        return parts

    @contextlib.contextmanager
    def step(self, loras: Sequence[LoRARequest | None], query_lens: np.ndarray) -> Iterator[None]:
        """Within: the model's LoRA layers compute under this step's plan (sequence i's
        `query_lens[i]` tokens under adapter `loras[i]`, or none)."""
        slots = self._activate(loras)
        self.context.plan = build_plan(slots, query_lens, self.device)
        try:
            yield
        finally:
            self.context.plan = None

    def _activate(self, loras: Sequence[LoRARequest | None]) -> np.ndarray:
        """Each sequence's slot, loading adapters the slots lack (at most `max_loras` of them)."""
        needed = set(loras) - {None}
        for lora in dict.fromkeys(n for n in loras if n is not None):
            if lora in self.slots:
                self.slots.move_to_end(lora)
                continue
            adapter = self._adapter(lora)  # first: a folder gone since costs no slot
            if not self.free_slots:
                victim = next(n for n in self.slots if n not in needed)
                self.free_slots.append(self.slots.pop(victim))
                self.num_slot_evictions += 1
            slot = self.free_slots.pop()
            self._write_slot(slot, adapter)
            self.slots[lora] = slot
            self.num_slot_loads += 1
        return np.fromiter((0 if n is None else self.slots[n] for n in loras), np.int64, len(loras))

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu_cache.get(request)
        if adapter is not None:
            self.cpu_cache.move_to_end(request)
            return adapter
        adapter = load_adapter(request, self.config.max_lora_rank)
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.cpu_cache[adapter.request] = adapter
        self.cpu_cache.move_to_end(adapter.request)
        while len(self.cpu_cache) > self.config.max_cpu_loras:
            self.cpu_cache.popitem(last=False)

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        weights = adapter.weights if adapter is not None else {}
        for name, layer in self.layers.items():
            layer.set_slot(slot, weights.get(name))

    def _check_targets(self, adapter: LoRAAdapter) -> None:
        unknown = sorted(set(adapter.weights) - set(self.layers))
        if unknown:
            raise ConfigError(
                f"LoRA adapter {adapter.name!r} adapts {unknown[0]}, which this model does not "
                f"have (is it an adapter of another base model?)"
            )
        for name, parts in adapter.weights.items():
            layer = self.layers[name]
            for part, (a, b) in parts.items():
                rows = layer.lora_b.shape[1] if part is None else layer.part_sizes[part]
                if a.shape[1] != layer.lora_a.shape[2] or b.shape[0] != rows:
                    raise ConfigError(
                        f"LoRA adapter {adapter.name!r}: {name} has A {tuple(a.shape)} and "
                        f"B {tuple(b.shape)}; the model's layer takes "
                        f"{layer.lora_a.shape[2]} inputs and {rows} outputs (another base model?)"
                    )
