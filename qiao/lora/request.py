"""`LoRARequest`: which adapter a request runs under, shaped like vLLM's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from qiao.errors import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name, id and folder: `LoRARequest("sql", 1, "/adapters/sql")`.

    The name is what requests select it by (`model: "base:sql"` online); the id, as vLLM's
    `lora_int_id`, tells apart two loads of the same name (a folder replaced between them).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name or ":" in self.lora_name:
            raise ConfigError(
                f"lora_name {self.lora_name!r}: must be non-empty and without ':' (requests "
                "name it as 'base:adapter')"
            )
        if self.lora_int_id < 1:
            raise ConfigError(
                f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}"
            )

    @property
    def block_hash_root(self) -> bytes:
        """The parent hash of a request's first KV block under this adapter: blocks computed
        under it are never shared with the base model or another adapter (or another load)."""
        key = f"lora\0{self.lora_name}\0{self.lora_int_id}\0{self.lora_path}"
        return hashlib.sha256(key.encode()).digest()
