"""Building one served version from its repository folder and its model's config.

`VersionBuilder` is the manager's loader: it runs in a worker thread and returns a version that
is fully loaded (weights read, KV cache or batcher set up) but not yet started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qiao.config import EngineConfig
from qiao.engine.async_engine import AdmissionLimits, AsyncEngine, EngineClient
from qiao.engine.batcher import BatcherConfig
from qiao.engine.breaker import BreakerConfig
from qiao.engine.encoder_process import EncoderSpec, ProcessEncoder
from qiao.engine.engine_process import ProcessEngine
from qiao.engine.llm_engine import LLMEngine
from qiao.errors import ConfigError
from qiao.repository.manager import Served
from qiao.repository.scan import ModelEntry, VersionDir
from qiao.repository.served import EncoderVersion, LLMVersion
from qiao.runner.encoder import Encoder


class VersionBuilder:
    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        seed: int = 0,
        in_process_engine: bool = False,
        log_level: str = "INFO",
        background: tuple[int, float, float] | None = None,
        ray: Any = None,
        ray_app_name: Callable[[str, str], str] | None = None,
    ) -> None:
        """Versions run in their own supervised process (an LLM's engine, an encoder), unless
        `in_process_engine` (an LLM engine's thread, an encoder in its batcher's thread).
        `background`: (priority, share, hold seconds) of the LLM engines' background work (batch
        lines). `ray`: `RayOptions` to run each LLM version as a Ray Serve application named
        `ray_app_name(model, version)`."""
        self.limits = limits
        self.ray = ray
        self.ray_app_name = ray_app_name or (lambda model, version: f"qiao-{model}-{version}")
        self.background = background
        self.seed = seed
        self.in_process_engine = in_process_engine
        self.log_level = log_level

    def breaker_config(self, entry: ModelEntry) -> BreakerConfig:
        """The server's breaker settings with the model's `circuit_breaker` keys over them."""
        base = self.limits.breaker
        own = entry.config.circuit_breaker if entry.config is not None else None
        if own is None:
            return base
        given = {k: v for k, v in own.model_dump().items() if v is not None}
        return dataclasses.replace(base, **given)

    def __call__(self, entry: ModelEntry, vdir: VersionDir) -> Served:
        config = entry.config
        assert config is not None
        if config.backend == "llm":
            if vdir.kind != "hf":
                raise ConfigError(
                    f"version {vdir.version}: an llm version must be an HF checkpoint"
                )
            return LLMVersion(
                entry.name,
                vdir.version,
                self._engine(entry, vdir),
                version_policy=config.triton_version_policy(),
            )
        if config.backend == "onnx" and vdir.kind != "onnx":
            raise ConfigError(f"version {vdir.version}: backend onnx needs a .onnx file")
        if config.backend == "embedding" and vdir.kind != "hf":
            raise ConfigError(f"version {vdir.version}: backend embedding needs an HF checkpoint")
        batching = BatcherConfig(**config.batcher_values())
        device = config.hardware.device_spec
        spec = EncoderSpec(
            str(vdir.path),
            config.backend,
            precision="FP32" if config.precision_mode == "AUTO" else config.precision_mode,
            device="cpu" if device == "auto" else device,
            max_length=config.max_sequence_length,
        )
        encoder = self.encoder(spec, name=f"{entry.name}/{vdir.version}")
        return EncoderVersion(
            entry.name,
            vdir.version,
            encoder,
            batching,
            backend=config.backend,
            breaker=self.breaker_config(entry),
            version_policy=config.triton_version_policy(),
        )

    def encoder(self, spec: EncoderSpec, *, name: str) -> Encoder:
        """The encoder of `spec`: in its own supervised process, or loaded here."""
        if self.in_process_engine:
            return spec.load()
        return ProcessEncoder.build(
            spec, name=name, stall_timeout=self.limits.stall_timeout, log_level=self.log_level
        )

    def _engine(self, entry: ModelEntry, vdir: VersionDir) -> EngineClient:
        config = entry.config
        assert config is not None
        kwargs: dict[str, Any] = config.engine_kwargs()
        if config.llm is None or "seed" not in config.llm.model_fields_set:
            kwargs["seed"] = self.seed
        if self.background is not None:
            priority, share, hold = self.background
            kwargs.update(
                background_priority=priority, background_share=share, background_hold_s=hold
            )
        engine_config = EngineConfig.create(str(vdir.path), **kwargs)
        limits = dataclasses.replace(self.limits, breaker=self.breaker_config(entry))
        if self.ray is not None:
            from qiao.engine.ray_replicas import RayEngine

            name = self.ray_app_name(entry.name, vdir.version)
            return RayEngine.build(engine_config, limits, self.ray, app_name=name)
        if self.in_process_engine:
            return AsyncEngine.build(lambda: LLMEngine(engine_config), limits)
        return ProcessEngine.build(engine_config, limits, log_level=self.log_level)
