"""Internal engine configuration: frozen dataclasses composed into one `EngineConfig`.

Each part validates itself once in `__post_init__`; errors name the field. The edges (the offline
`LLM(...)` keyword arguments, the CLI) build these; nothing below the engine reads settings from
anywhere else.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qiao.errors import ConfigError

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")
QUANTIZATIONS = ("int8", "w8a8", "int4")
SPECULATIVE_METHODS = ("ngram", "draft")
# CPU default for the KV cache when no budget is given: this share of RAM, capped below.
DEFAULT_CPU_KV_FRACTION = 0.10
DEFAULT_CPU_KV_CAP_BYTES = 4 << 30
DEFAULT_GPU_KV_FRACTION = 0.80


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint, in which dtype, up to which context length."""

    model: str
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    tokenizer: str | None = None  # None: the model directory
    skip_tokenizer_init: bool = False
    seed: int = 0
    quantization: str | None = None  # "int8": weight-only int8 linears (per-channel scales);
    # "w8a8": int8 weights and per-token int8 activations, int32 products;
    # "int4": group-wise 4-bit weights (implied by an AWQ / GPTQ checkpoint)
    # Every token's result independent of the batch it runs in (CPU; see linear_method).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must name a checkpoint directory")
        _require(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {QUANTIZATIONS} or None, got {self.quantization!r}",
        )
        _require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _require(
            self.load_format in LOAD_FORMATS,
            "load_format",
            f"must be one of {LOAD_FORMATS}, got {self.load_format!r}",
        )
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", "must be >= 1")

    @property
    def path(self) -> Path:
        return Path(self.model).expanduser()


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: one fixed pool of `block_size`-token blocks.

    Pool size, first match wins: `num_kv_blocks`; `kv_cache_memory` in bytes (> 1) or as a share
    of device memory (0 < x <= 1); the platform default (CPU: 10 % of RAM capped at 4 GiB).
    """

    block_size: int = 16
    kv_cache_memory: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # The cache's storage dtype; "auto": the model's. "bfloat16" under a float32 model halves the
    # bytes attention reads per context token (and doubles the tokens a pool holds); attention
    # still computes in float32.
    kv_cache_dtype: str = "auto"
    # Share of the pool that freed blocks may fill (kept as prefix cache) before never-used
    # blocks are handed out; past it the least recently freed are reused, so the memory touched
    # follows the load. 1.0 (default): the whole pool is prefix cache before any cached block
    # is evicted.
    prefix_cache_reserve: float = 1.0

    def __post_init__(self) -> None:
        _require(
            0.0 <= self.prefix_cache_reserve <= 1.0,
            "prefix_cache_reserve",
            f"must be a share of the pool in [0, 1], got {self.prefix_cache_reserve!r}",
        )
        _require(
            self.kv_cache_dtype in DTYPES,
            "kv_cache_dtype",
            f"must be one of {DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.block_size in (8, 16, 32, 64, 128), "block_size", "must be 8, 16, 32, 64 or 128"
        )
        if self.kv_cache_memory is not None:
            _require(
                self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 (bytes, or a share <= 1)"
            )
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # Requests at this priority or less urgent (a larger number) are background work (batch
    # lines): queued behind every other request whatever the policy (and among themselves by
    # priority), preempted first, and, while any other request runs or waits, given at most
    # `background_share` of the sequences and tokens the other requests took in the step (at
    # least one of each; the others wait, keeping their cache); with no other request they take
    # the whole step. None: no request is background.
    background_priority: int | None = None
    background_share: float = 1.0
    # Seconds after the last step with another request during which background work stays held
    # to the share of that step (a client sending requests back to back meets short steps).
    background_hold_s: float = 0.0
    # Adaptive batching (qiao/engine/adaptive.py): the step token budget moves within
    # [adaptive_min_batched_tokens, max_num_batched_tokens] to hold the time of decode steps
    # (the inter-token latency) at target_itl_ms * (1 ± target_itl_tolerance). None: off.
    target_itl_ms: float | None = None
    target_itl_tolerance: float = 0.2
    adaptive_min_batched_tokens: int = 32

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(
            self.target_itl_ms is None or self.target_itl_ms > 0, "target_itl_ms", "must be > 0"
        )
        _require(
            0.0 <= self.target_itl_tolerance < 1.0, "target_itl_tolerance", "must be in [0, 1)"
        )
        _require(
            self.adaptive_min_batched_tokens >= 1, "adaptive_min_batched_tokens", "must be >= 1"
        )
        _require(0.0 < self.background_share <= 1.0, "background_share", "must be in (0, 1]")
        _require(self.background_hold_s >= 0.0, "background_hold_s", "must be >= 0")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        _require(
            self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}"
        )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (qiao/spec_decode): each decode step of a request verifies up to
    `num_speculative_tokens` proposed tokens in the same forward as its next token."""

    # "ngram": prompt lookup, the tokens that followed the latest earlier occurrence of the
    # request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). "draft":
    # the greedy tokens of a smaller model with the same vocabulary (`model`).
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft checkpoint directory (method "draft")

    def __post_init__(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            "speculative_method",
            f"must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        _require(self.num_speculative_tokens >= 1, "num_speculative_tokens", "must be >= 1")
        _require(self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be >= 1")
        _require(
            self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            f"must be >= prompt_lookup_min ({self.prompt_lookup_min})",
        )
        _require(
            (self.method == "draft") == (self.model is not None),
            "speculative_model",
            "names the draft checkpoint: needed with speculative_method draft, and only then",
        )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (qiao/lora): adapters on `max_loras` device slots, up to
    `max_cpu_loras` of them kept loaded on the CPU; `lora_modules` (name, folder) loaded at start."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras", "must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        _require(
            self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"must be >= max_loras ({self.max_loras})",
        )
        object.__setattr__(
            self, "lora_modules", tuple((str(n), str(p)) for n, p in self.lora_modules)
        )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed once and validated across parts."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    # CUDA graphs for pure-decode steps; None: on for a CUDA device, off elsewhere.
    cuda_graphs: bool | None = None
    # Ranks the model is split over (torch.distributed, one process per rank; 1: no split).
    tensor_parallel_size: int = 1
    # None: no speculative decoding.
    speculative: SpeculativeConfig | None = None
    # Multi-LoRA serving; None: off (no adapter can be loaded).
    lora: LoRAConfig | None = None

    @classmethod
    def create(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        kv_cache_memory: float | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_dtype: str = "auto",
        prefix_cache_reserve: float = 1.0,
        scheduling_policy: str = "fcfs",
        background_priority: int | None = None,
        background_share: float = 1.0,
        background_hold_s: float = 0.0,
        target_itl_ms: float | None = None,
        target_itl_tolerance: float = 0.2,
        adaptive_min_batched_tokens: int = 32,
        seed: int = 0,
        device: str = "auto",
        skip_tokenizer_init: bool = False,
        quantization: str | None = None,
        cuda_graphs: bool | None = None,
        batch_invariant: bool = False,
        tensor_parallel_size: int = 1,
        speculative_method: str | None = None,
        num_speculative_tokens: int = 4,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        speculative_model: str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_modules: Any = (),
    ) -> EngineConfig:
        """The flat keyword form the edges (`LLM(...)`, `qiao serve`) share."""
        return cls(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                load_format=load_format,
                max_model_len=max_model_len,
                tokenizer=tokenizer,
                skip_tokenizer_init=skip_tokenizer_init,
                seed=seed,
                quantization=quantization,
                batch_invariant=batch_invariant,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory=kv_cache_memory,
                num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
                prefix_cache_reserve=prefix_cache_reserve,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=scheduling_policy,
                background_priority=background_priority,
                background_share=background_share,
                background_hold_s=background_hold_s,
                target_itl_ms=target_itl_ms,
                target_itl_tolerance=target_itl_tolerance,
                adaptive_min_batched_tokens=adaptive_min_batched_tokens,
            ),
            device=device,
            cuda_graphs=cuda_graphs,
            tensor_parallel_size=tensor_parallel_size,
            speculative=None
            if speculative_method is None
            else SpeculativeConfig(
                method=speculative_method,
                num_speculative_tokens=num_speculative_tokens,
                prompt_lookup_min=prompt_lookup_min,
                prompt_lookup_max=prompt_lookup_max,
                model=speculative_model,
            ),
            lora=LoRAConfig(
                max_loras=max_loras,
                max_lora_rank=max_lora_rank,
                max_cpu_loras=max_cpu_loras,
                lora_modules=parse_lora_modules(lora_modules),
            )
            if enable_lora
            else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for an engine process): `from_dict` rebuilds the same config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineConfig:
        return cls(
            model=ModelConfig(**data["model"]),
            cache=CacheConfig(**data["cache"]),
            scheduler=SchedulerConfig(**data["scheduler"]),
            device=data["device"],
            cuda_graphs=data["cuda_graphs"],
            tensor_parallel_size=data.get("tensor_parallel_size", 1),
            speculative=(
                SpeculativeConfig(**data["speculative"]) if data.get("speculative") else None
            ),
            lora=LoRAConfig(**data["lora"]) if data.get("lora") else None,
        )

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _require(
            self.lora is None or self.tensor_parallel_size == 1,
            "enable_lora",
            "does not work with tensor_parallel_size > 1 yet (serve adapters on one rank)",
        )
        if not self.scheduler.enable_chunked_prefill and self.model.max_model_len is not None:
            _require(
                self.scheduler.max_num_batched_tokens >= self.model.max_model_len,
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.model.max_model_len}) without chunked prefill",
            )


def parse_lora_modules(modules: Any) -> tuple[tuple[str, str], ...]:
    """(name, folder) pairs from vLLM's `--lora-modules` forms: "name=path", a JSON object
    string '{"name": ..., "path": ...}', a dict of either shape ({name: path} too), or pairs;
    one string may hold several name=path entries (space- or comma-separated) or a JSON list.

    E.g. ["sql=/a/sql", '{"name": "chat", "path": "/p"}'] -> (("sql", "/a/sql"), ("chat", "/p"))
    """
    if isinstance(modules, str):
        text = modules.strip()
        if text.startswith("["):
            try:
                modules = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"lora_modules: {text!r} is not valid JSON ({exc})") from None
        else:
            modules = [text] if text.startswith("{") else text.replace(",", " ").split()
    if isinstance(modules, dict):
        modules = [modules]
    pairs: list[tuple[str, str]] = []
    for item in modules or ():
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"lora_modules: {item!r} is not valid JSON ({exc})") from None
        if isinstance(item, dict) and "name" in item and "path" in item:
            pairs.append((str(item["name"]), str(item["path"])))
        elif isinstance(item, dict):
            pairs.extend((str(n), str(p)) for n, p in item.items())
        elif isinstance(item, str) and "=" in item:
            name, _, path = item.partition("=")
            pairs.append((name.strip(), path.strip()))
        elif isinstance(item, list | tuple) and len(item) == 2:
            pairs.append((str(item[0]), str(item[1])))
        else:
            raise ConfigError(
                f'lora_modules: {item!r}; expected name=path or {{"name": "...", "path": "..."}}'
            )
    names = [n for n, _ in pairs]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    _require(duplicate is None, "lora_modules", f"names {duplicate!r} twice")
    return tuple(pairs)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{name} {message}")
