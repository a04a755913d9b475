"""The per-model config of a model repository: `DIR/<model>/config.yaml` (or `.yml`, `.json`).

One schema (pydantic, `extra="forbid"` and strict types at every level) for the keys below; any
error becomes a `ConfigError` naming the file and the dotted key, e.g.
`models/embed/config.yaml: dynamic_batching.preferred_batch_size.0: Input should be >= 1`.

    backend: llm | embedding | onnx                      (required)
    precision_mode: FP32 | FP16 | BF16 | INT8 | AUTO     (default FP32; any case; AUTO = the
                                                          checkpoint's own dtype, as `--dtype auto`;
                                                          INT8: backend embedding only, W8A8
                                                          linear layers on the CPU)
    max_batch_size: 64                                   (encoders; >= 1)
    max_sequence_length: 256                             (encoders; optional cap on tokens)
    dynamic_batching:                                    (encoders; absent = no delay, no
      preferred_batch_size: [4, 8]                        preferred sizes: run what is queued)
      max_queue_delay_microseconds: 10000                (>= 0, default 0)
      target_p99_ms: 50                                  (adaptive batching: the queue delay
                                                          moves to hold the p99 request latency
                                                          here; default off)
      target_p99_tolerance: 0.2                          (its dead band, a share; default 0.2)
      min_queue_delay_microseconds: 100                  (the shortest delay it picks, >= 1)
      priority_levels: 2                                 (>= 1, default 1)
      default_priority_level: 0                          (0..priority_levels, default 0)
      default_queue_policy:                              (its three keys may also be given
        max_queue_size: 128                               directly under dynamic_batching;
        default_timeout_microseconds: 0                   0 = unbounded / no timeout)
        allow_timeout_override: false
    hardware:
      device: auto | cpu | cuda                          (default auto)
      gpu_id: 0                                          (>= 0; only with device: cuda)
      workspace_size: 512MiB                             (the model's memory budget, bytes or
                                                          "<n>[B|KB|MB|GB|TB|KiB|MiB|GiB|TiB]";
                                                          the KV cache of an llm, validated but
                                                          not used by encoders)
    version_policy: {latest: {num_versions: 1}}          (default) | all | {all: {}}
                    | {specific: {versions: [1, 3]}}
    traffic: {"1": 90, "2": 10}                          (initial canary split; default: all to
                                                          the newest ready version)
    circuit_breaker:                                     (any model; each key defaults to the
      failures: 5                                         server's --breaker-* flag; >= 0,
      window: 30                                          0 = never opens; window and cooldown
      cooldown: 10                                        in seconds, > 0)
    response_cache:                                      (any model; each key defaults to the
      enabled: true                                       server's --response-cache[-ttl]; ttl
      ttl: 60                                             in seconds, > 0)
    llm:                                                 (llm only; the `qiao serve` engine flags)
      max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
      enable_prefix_caching, block_size, kv_cache_memory, num_kv_blocks, kv_cache_dtype,
      prefix_cache_reserve, quantization, load_format, seed, scheduling_policy, cuda_graphs
      (torch's thread count is per process: `qiao serve --num-threads`)

The result is a frozen `ModelConfigFile`; `batcher_values()` and `engine_kwargs()` turn it into the
batcher's and the LLM engine's settings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from qiao.config import EngineConfig
from qiao.errors import ConfigError
from qiao.settings_schema import pydantic_fields

CONFIG_FILE_NAMES = ("config.yaml", "config.yml", "config.json")
MAX_CONFIG_FILE_BYTES = 1 << 20
ENCODER_BACKENDS = ("embedding", "onnx")
# precision_mode -> the dtype name torch, `EngineConfig` and `hal.resolve_dtype` understand.
PRECISION_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "AUTO": "auto"}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", re.ASCII)
# Keys people carry over from `qiao serve` that live elsewhere in this file.
_MOVED_KEYS = {
    "llm.dtype": "set precision_mode (top level) instead",
    "llm.device": "set hardware.device (and hardware.gpu_id) instead",
    "llm.max_batch_size": "an llm batches by llm.max_num_seqs",
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class QueuePolicy(_Section):
    max_queue_size: int = Field(0, ge=0)  # 0: unbounded
    default_timeout_microseconds: int = Field(0, ge=0)  # 0: no timeout
    allow_timeout_override: bool = False


class DynamicBatching(_Section):
    preferred_batch_size: list[int] = Field(default_factory=list)
    max_queue_delay_microseconds: int = Field(0, ge=0)
    # Adaptive batching: the queue delay moves within [min_queue_delay_microseconds,
    # max_queue_delay_microseconds] to hold the p99 request latency at target_p99_ms.
    target_p99_ms: float | None = Field(None, gt=0)
    target_p99_tolerance: float = Field(0.2, ge=0, lt=1)
    min_queue_delay_microseconds: int = Field(100, ge=1)
    priority_levels: int = Field(1, ge=1)
    default_priority_level: int = Field(0, ge=0)
    default_queue_policy: QueuePolicy = Field(default_factory=QueuePolicy)

    @model_validator(mode="before")
    @classmethod
    def _flat_queue_policy(cls, data: Any) -> Any:
        """Queue-policy keys given directly under dynamic_batching move into the policy."""
        if not isinstance(data, dict):
            return data
        flat = {k: data[k] for k in QueuePolicy.model_fields if k in data}
        if not flat:
            return data
        policy = data.get("default_queue_policy", {})
        if not isinstance(policy, dict):
            return data
        twice = sorted(set(flat) & set(policy))
        if twice:
            raise ValueError(
                f"{', '.join(twice)} given both directly and under default_queue_policy"
            )
        rest = {k: v for k, v in data.items() if k not in flat}
        return {**rest, "default_queue_policy": {**policy, **flat}}

    @field_validator("preferred_batch_size", mode="before")
    @classmethod
    def _one_size(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("preferred_batch_size")
    @classmethod
    def _distinct_sizes(cls, value: list[int]) -> list[int]:
        if any(size < 1 for size in value):
            raise ValueError("every size must be >= 1")
        if len(set(value)) != len(value):
            raise ValueError("sizes must be distinct")
        return sorted(value)

    @field_validator("default_priority_level")
    @classmethod
    def _known_level(cls, value: int, info: ValidationInfo) -> int:
        levels = info.data.get("priority_levels")
        if levels is not None and value > levels:
            raise ValueError(f"must be in 0..priority_levels ({levels})")
        return value


class Hardware(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpu_id: int | None = Field(None, ge=0)
    workspace_size: int | None = Field(None, ge=1)  # bytes

    @field_validator("workspace_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("gpu_id")
    @classmethod
    def _cuda_only(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("device") != "cuda":
            raise ValueError("needs device: cuda")
        return value

    @property
    def device_spec(self) -> str:
        """`EngineConfig.device`: "auto", "cpu", "cuda" or "cuda:N"."""
        if self.device == "cuda" and self.gpu_id is not None:
            return f"cuda:{self.gpu_id}"
        return self.device


class LatestPolicy(_Section):
    num_versions: int = Field(1, ge=1)


class AllPolicy(_Section):
    pass


class SpecificPolicy(_Section):
    versions: list[str] = Field(min_length=1)

    @field_validator("versions", mode="before")
    @classmethod
    def _canonical(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        versions = [_version_key(v) for v in value]
        if len(set(versions)) != len(versions):
            raise ValueError("versions must be distinct")
        return sorted(versions, key=int)


class VersionPolicy(_Section):
    """Exactly one of `latest`, `all`, `specific`; none given means latest 1 (Triton's)."""

    latest: LatestPolicy | None = None
    all: AllPolicy | None = None
    specific: SpecificPolicy | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if data == "all":
            return {"all": {}}
        if isinstance(data, dict):
            # `{all: }` in YAML reads as {"all": None}: the same as an empty mapping.
            data = {k: ({} if v is None else v) for k, v in data.items()}
            if not data:
                return {"latest": {}}
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> VersionPolicy:
        chosen = [k for k in ("latest", "all", "specific") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError("give exactly one of latest, all, specific")
        return self

    @property
    def kind(self) -> str:
        return "latest" if self.latest else "specific" if self.specific else "all"

    def select(self, versions: Iterable[str]) -> list[str]:
        """The versions this policy serves out of `versions` (numeric strings), ascending."""
        ordered = sorted(set(versions), key=int)
        if self.latest is not None:
            return ordered[-self.latest.num_versions :]
        if self.specific is not None:
            wanted = set(self.specific.versions)
            return [v for v in ordered if v in wanted]
        return ordered


# The `llm:` block: `qiao serve`'s engine settings (qiao/settings_schema.py), same names, ranges
# and defaults.
LLM_SETTINGS = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "target_itl_ms",
    "target_itl_tolerance",
    "adaptive_min_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "block_size",
    "kv_cache_memory",
    "num_kv_blocks",
    "kv_cache_dtype",
    "prefix_cache_reserve",
    "quantization",
    "load_format",
    "seed",
    "scheduling_policy",
    "cuda_graphs",
)
LLMSettings: Any = create_model(
    "LLMSettings",
    __base__=_Section,
    __module__=__name__,
    **pydantic_fields(LLM_SETTINGS, cli=False),
)


class CircuitBreakerSettings(_Section):
    """The model's circuit breaker; a key left out takes the server's `--breaker-*` value."""

    failures: int | None = Field(None, ge=0)
    window: float | None = Field(None, gt=0, allow_inf_nan=False)
    cooldown: float | None = Field(None, gt=0, allow_inf_nan=False)


class ResponseCacheSettings(_Section):
    """The model's response cache (qiao/api/response_cache.py): on or off for this model (left
    out: the server's --response-cache) and its entries' lifetime (left out: the server's)."""

    enabled: bool | None = None
    ttl: float | None = Field(None, gt=0, allow_inf_nan=False)


class ModelConfigFile(_Section):
    """One model's config, validated; see the module docstring for the keys."""

    backend: Literal["llm", "embedding", "onnx"]
    precision_mode: Literal["FP32", "FP16", "BF16", "INT8", "AUTO"] = "FP32"
    max_batch_size: int = Field(64, ge=1)
    max_sequence_length: int | None = Field(None, ge=1)
    dynamic_batching: DynamicBatching | None = None
    hardware: Hardware = Field(default_factory=Hardware)
    version_policy: VersionPolicy = Field(
        default_factory=lambda: VersionPolicy(latest=LatestPolicy())
    )
    traffic: dict[str, float] | None = None
    circuit_breaker: CircuitBreakerSettings | None = None
    response_cache: ResponseCacheSettings | None = None
    llm: LLMSettings | None = None

    @field_validator("precision_mode", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("traffic", mode="before")
    @classmethod
    def _traffic_versions(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        weights = {_version_key(v): w for v, w in value.items()}
        if len(weights) != len(value):
            raise ValueError("a version is given twice")
        return dict(sorted(weights.items(), key=lambda item: int(item[0])))

    @field_validator("traffic")
    @classmethod
    def _weights(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        for version, weight in value.items():
            if not (0 <= weight < float("inf")):
                raise ValueError(f"weight of version {version} must be >= 0 and finite")
        if not any(weight > 0 for weight in value.values()):
            raise ValueError("at least one weight must be > 0")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfigFile:
        """Cross-key rules; each message starts with the dotted key it is about."""
        problems = []
        given = self.model_fields_set
        if self.backend == "llm":
            problems += [
                f"{key}: only for encoder backends ({', '.join(ENCODER_BACKENDS)}), not llm"
                for key in ("dynamic_batching", "max_batch_size", "max_sequence_length")
                if key in given
            ]
            if (
                self.llm is not None
                and self.llm.kv_cache_memory is not None
                and self.hardware.workspace_size is not None
            ):
                problems.append(
                    "llm.kv_cache_memory: give either it or hardware.workspace_size, not both"
                )
            problems += self._engine_problems()
        elif self.llm is not None:
            problems.append(f"llm: only for backend llm, not {self.backend}")
        if self.precision_mode == "INT8" and self.backend != "embedding":
            problems.append(_INT8_ONLY_EMBEDDING[self.backend])
        if self.dynamic_batching is not None:
            too_big = [
                s for s in self.dynamic_batching.preferred_batch_size if s > self.max_batch_size
            ]
            if too_big:
                problems.append(
                    f"dynamic_batching.preferred_batch_size: {too_big} exceed max_batch_size "
                    f"({self.max_batch_size})"
                )
        if self.traffic is not None and self.version_policy.specific is not None:
            outside = sorted(
                set(self.traffic) - set(self.version_policy.specific.versions), key=int
            )
            if outside:
                problems.append(
                    f"traffic: version(s) {', '.join(outside)} are not in "
                    "version_policy.specific.versions"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _engine_problems(self) -> list[str]:
        """What `EngineConfig` itself rejects (e.g. max_num_batched_tokens < max_model_len
        without chunked prefill), named as llm.<key>."""
        try:
            EngineConfig.create("<model>", **self.engine_kwargs())
        except ConfigError as exc:
            key = str(exc).split(" ", 1)[0]
            key = {"policy": "scheduling_policy"}.get(key, key)
            return [f"llm.{key}: {str(exc).split(' ', 1)[-1]}"]
        return []

    # --- what the rest of the platform reads ---------------------------------------------------

    @property
    def is_encoder(self) -> bool:
        return self.backend in ENCODER_BACKENDS

    @property
    def dtype_name(self) -> str:
        """precision_mode as a dtype name: "float32", "float16", "bfloat16" (or "auto"). INT8
        (an encoder's W8A8 linear layers) computes the rest in float32."""
        return PRECISION_DTYPES.get(self.precision_mode, "float32")

    def triton_version_policy(self) -> dict[str, Any]:
        """`version_policy` as Triton's model configuration writes it (versions as integers)."""
        policy = self.version_policy.model_dump(exclude_none=True)
        if "specific" in policy:
            policy["specific"] = {"versions": [int(v) for v in policy["specific"]["versions"]]}
        return policy

    def batcher_values(self) -> dict[str, Any]:
        """`BatcherConfig(**values)` for an encoder. Without a dynamic_batching block: no delay
        and no preferred sizes (each batch is what is queued). Triton's zeros: max_queue_size 0
        is unbounded, default_timeout_us 0 is no timeout."""
        batching = self.dynamic_batching or DynamicBatching()
        policy = batching.default_queue_policy
        return {
            "max_batch_size": self.max_batch_size,
            "preferred_batch_sizes": tuple(batching.preferred_batch_size),
            "max_queue_delay_us": batching.max_queue_delay_microseconds,
            "priority_levels": batching.priority_levels,
            "default_priority_level": batching.default_priority_level,
            "max_queue_size": policy.max_queue_size,
            "default_timeout_us": policy.default_timeout_microseconds,
            "allow_timeout_override": policy.allow_timeout_override,
            # Adaptive batching, only when a target is set.
            **(
                {
                    "target_p99_ms": batching.target_p99_ms,
                    "target_p99_tolerance": batching.target_p99_tolerance,
                    "min_queue_delay_us": batching.min_queue_delay_microseconds,
                }
                if batching.target_p99_ms is not None
                else {}
            ),
        }

    def engine_kwargs(self) -> dict[str, Any]:
        """`EngineConfig.create(version_dir, **kwargs)` for an llm: the llm block, precision_mode
        as dtype, hardware.device (+ gpu_id) as device, hardware.workspace_size as the KV cache
        budget when llm.kv_cache_memory is not set."""
        llm = self.llm or LLMSettings()
        # A setting left None takes the engine's default.
        kwargs = {k: v for k, v in llm.model_dump().items() if v is not None or k in _NONE_OK}
        if kwargs["kv_cache_memory"] is None and self.hardware.workspace_size is not None:
            kwargs["kv_cache_memory"] = float(self.hardware.workspace_size)
        return {**kwargs, "dtype": self.dtype_name, "device": self.hardware.device_spec}


# Why precision_mode INT8 (W8A8 encoder linears) is refused for a backend, and what to use.
_INT8_ONLY_EMBEDDING = {
    "llm": "precision_mode: INT8 is for backend embedding; an llm's int8 weights are "
    "llm.quantization (int8 or w8a8) with precision_mode FP32, BF16 or AUTO",
    "onnx": "precision_mode: INT8 is for backend embedding; the onnx backend runs the exported "
    "FP32 graph",
}


# Settings whose None the engine takes as a value (no limit, the device's default, ...).
_NONE_OK = ("max_model_len", "kv_cache_memory", "num_kv_blocks", "quantization", "cuda_graphs")


def parse_size(text: str) -> int:
    """ "512MiB" -> 536870912; "2GB" -> 2000000000; "1024" -> 1024 (bytes)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 1073741824, 512MiB or 2GB")
    number, unit = match.groups()
    if unit.lower() not in _SIZE_UNITS:
        raise ValueError(f"unknown unit {unit!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    size = float(number) * _SIZE_UNITS[unit.lower()]
    if not (1 <= size < 2**63):
        raise ValueError(f"{text!r} must be at least 1 byte and below 8 EiB")
    return int(size)


def _version_key(version: Any) -> str:
    # scan.py imports this module (to read configs), so its name rules load on first use.
    from qiao.repository.scan import check_version

    return check_version(version)


# --- reading files -----------------------------------------------------------------------------


def find_config_file(model_dir: Path, display: str | None = None) -> Path | None:
    """The model's config file, or None when there is none. Two or more is an error."""
    found = [model_dir / name for name in CONFIG_FILE_NAMES if (model_dir / name).is_file()]
    if len(found) > 1:
        names = " and ".join(p.name for p in found)
        raise ConfigError(f"{display or model_dir}: {names} both exist; keep exactly one")
    return found[0] if found else None


def read_model_config(path: Path, display: str | None = None) -> ModelConfigFile:
    """Parse and validate one config file. Errors start with `display` (default: the path)."""
    shown = display or str(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot be read ({exc.strerror})") from None
    return parse_config_bytes(raw, path.suffix, shown)


def parse_config_bytes(raw: bytes, suffix: str, display: str) -> ModelConfigFile:
    """Parse and validate a config file's bytes: JSON when `suffix` is ".json", else YAML.
    A repository on object storage reads its files this way (at most MAX_CONFIG_FILE_BYTES + 1
    of them, so an oversized file is refused without reading it whole)."""
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"{display}: larger than {MAX_CONFIG_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
        data = _load_json(text) if suffix == ".json" else _load_yaml(text)
    except (ValueError, yaml.YAMLError) as exc:
        kind = "JSON" if suffix == ".json" else "YAML"
        raise ConfigError(f"{display}: not valid {kind}: {_one_line(exc)}") from None
    return parse_model_config(data, display)


def parse_model_config(data: Any, display: str) -> ModelConfigFile:
    """Validate already-parsed config data; errors start with `display`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{display}: must hold a mapping of keys (backend: ..., ...)")
    try:
        return ModelConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{display}: {describe_errors(exc)}") from None


def single_model_config(
    backend: str = "llm",
    *,
    dtype: str = "auto",
    device: str = "auto",
    llm: Mapping[str, Any] | None = None,
    **keys: Any,
) -> ModelConfigFile:
    """The config `qiao serve --model PATH` stands for: a one-model repository whose model
    serves the folder as version 1. `dtype` and `device` take the `qiao serve` spellings
    ("auto", "float16", "cuda:1", ...); `llm` takes the engine flags; `keys` any other key."""
    precision = {name: mode for mode, name in PRECISION_DTYPES.items()}.get(dtype, dtype)
    kind, _, gpu = device.partition(":")
    hardware: dict[str, Any] = {"device": kind}
    if gpu:
        if not gpu.isdigit():
            raise ConfigError(f"--model: device {device!r}: use auto, cpu, cuda or cuda:N")
        hardware["gpu_id"] = int(gpu)
    data: dict[str, Any] = {
        "backend": backend,
        "precision_mode": precision,
        "hardware": {**hardware, **keys.pop("hardware", {})},
        "version_policy": {"latest": {"num_versions": 1}},
        **keys,
    }
    if llm is not None:
        data["llm"] = dict(llm)
    return parse_model_config(data, "--model")


def describe_errors(exc: ValidationError) -> str:
    """pydantic errors as "dotted.key: what is wrong" parts joined by "; "."""
    parts = []
    for error in exc.errors(include_url=False):
        key = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = _MOVED_KEYS.get(key) or _unknown_key(error["loc"])
        elif error["type"] not in ("missing", "value_error") and _is_scalar(error.get("input")):
            message += f" (got {error['input']!r})"
        parts.append(f"{key}: {message}" if key else message)
    return "; ".join(parts)


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """ "unknown key; allowed: ..." for the section the key was found in."""
    section: type[BaseModel] | None = ModelConfigFile
    for part in loc[:-1]:
        field = section.model_fields.get(str(part)) if section is not None else None
        section = _model_in(field.annotation) if field is not None else None
    if section is None:
        return "unknown key"
    return f"unknown key; allowed: {', '.join(section.model_fields)}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 60


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _load_json(text: str) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"key(s) {', '.join(twice)} given twice")
        return dict(pairs)

    return json.loads(text, object_pairs_hook=no_duplicates)


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
