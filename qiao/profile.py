"""Tuning profiles: what `qiao tune` measured on one machine for one model, and where it lives.

A profile is a JSON file holding the machine it was measured on, the model it was measured for
(checkpoint path or built-in shape, dtype, quantization), the chosen engine settings
(`num_threads`, `max_num_seqs`, `max_num_batched_tokens`, `num_kv_blocks`) and the measurements
behind each choice. `qiao tune` writes it to `profile_path(model, machine)`; `LLM(...)` and
`qiao serve` read it back from there (`find_profile`) and take their defaults from it.

A profile that does not fit (another machine, another qiao version or schema) is ignored with a
warning naming why; one that cannot be read as a profile is a `ConfigError` naming the file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qiao import envs
from qiao.errors import ConfigError
from qiao.version import __version__

logger = logging.getLogger("qiao.profile")

SCHEMA_VERSION = 1
# The engine settings a profile supplies defaults for, in the order they are reported.
TUNED_SETTINGS = ("num_threads", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks")
# `LLM(profile=...)` / `qiao serve --profile`: "auto" (this model's profile on this machine, if
# any), a profile file, or None (no profile).
ProfileChoice = str | Path | None


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


class MachineFacts(_Frozen):
    """The machine a profile was measured on. `key()` decides whether it is this machine."""

    cpu_model: str
    num_cpus: int = Field(ge=1)  # CPUs this process may run on (affinity), not the host's
    num_physical_cores: int = Field(ge=1)  # cores behind those CPUs (no SMT siblings)
    accelerator: str | None  # the CUDA device's name; None on a CPU-only machine
    torch_version: str

    @classmethod
    def current(cls) -> MachineFacts:
        import torch

        accelerator = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        cpus = _usable_cpus()
        return cls(
            cpu_model=cpu_model(),
            num_cpus=len(cpus),
            num_physical_cores=_physical_cores(cpus),
            accelerator=accelerator,
            torch_version=torch.__version__,
        )

    def key(self) -> tuple[str, int, int, str | None]:
        """What makes two machines the same for tuning. The torch version is a fact only."""
        return (self.cpu_model, self.num_cpus, self.num_physical_cores, self.accelerator)

    def describe(self) -> str:
        device = f", {self.accelerator}" if self.accelerator else ""
        cpus = f"{self.num_cpus} CPUs on {self.num_physical_cores} cores"
        return f"{self.cpu_model!r} with {cpus}{device}"


class ModelIdentity(_Frozen):
    """The model a profile is for: a checkpoint directory (resolved) or a built-in shape."""

    model: str | None = None
    shape: str | None = None
    dtype: str  # the resolved compute dtype, never "auto"
    quantization: str | None = None

    @classmethod
    def for_checkpoint(
        cls, path: str | Path, dtype: str, quantization: str | None
    ) -> ModelIdentity:
        resolved = str(Path(path).expanduser().resolve())
        return cls(model=resolved, dtype=dtype, quantization=quantization)

    def name(self) -> str:
        """A short readable name: the shape, or the checkpoint directory's name."""
        return self.shape or Path(self.model or "model").name

    def describe(self) -> str:
        source = f"shape {self.shape}" if self.shape else str(self.model)
        return f"{source} ({self.dtype}{', ' + self.quantization if self.quantization else ''})"


class TunedSettings(_Frozen):
    """The engine settings `qiao tune` chose; each is a default, never an override."""

    num_threads: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    num_kv_blocks: int = Field(ge=1)


class Profile(_Frozen):
    """One profile file. `measurements` holds, per setting, the candidates measured and why the
    chosen one won; its layout is for people and may grow without a schema change."""

    schema_version: int
    qiao_version: str
    created_at: str
    quick: bool  # measured with `qiao tune --quick`: fewer, shorter runs
    machine: MachineFacts
    model: ModelIdentity
    block_size: int = Field(ge=1)  # num_kv_blocks counts blocks of this many tokens
    settings: TunedSettings
    measurements: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def mismatch(self, machine: MachineFacts) -> str | None:
        """Why this profile does not apply on `machine`; None when it does."""
        if self.machine.key() != machine.key():
            return (
                f"it was measured on another machine ({self.machine.describe()}; this one is "
                f"{machine.describe()})"
            )
        return None


def profile_path(model: ModelIdentity, machine: MachineFacts) -> Path:
    """Where the profile of `model` on `machine` lives: `<QIAO_PROFILE_DIR>/<name>-<hash>.json`."""
    identity = {"model": model.model_dump(mode="json"), "machine": list(machine.key())}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    quant = f"-{model.quantization}" if model.quantization else ""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.name())
    return envs.profile_dir() / f"{name}-{model.dtype}{quant}-{digest}.json"


def write_profile(profile: Profile, path: Path) -> Path:
    """Write `profile` to `path` (parents created) atomically: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> Profile:
    """Read a profile file; ConfigError naming the file (and the bad field) when it is not one,
    or when it was written by another qiao version or schema (`foreign_reason`)."""
    path = Path(path).expanduser()
    data = _read_json(path)
    why_not = foreign_reason(data)
    if why_not is not None:
        raise ConfigError(f"profile {path} cannot be used: {why_not}; rerun `qiao tune`")
    return _validate(data, path)


def foreign_reason(data: dict[str, Any]) -> str | None:
    """Why a profile's raw JSON comes from another qiao (version or schema); None if ours.

    Checked before the schema, which another version may have changed."""
    schema, version = data.get("schema_version"), data.get("qiao_version")
    # Missing or mistyped, they are not another qiao's: the schema check names them.
    if isinstance(schema, int) and schema != SCHEMA_VERSION:
        return f"it has schema version {schema}, this qiao reads {SCHEMA_VERSION}"
    if isinstance(version, str) and version != __version__:
        return f"it was made by qiao {version}, this is qiao {__version__}"
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"profile {path} cannot be read ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"profile {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path} is not a qiao tuning profile: expected a JSON object")
    return data


def _validate(data: dict[str, Any], path: Path) -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            f"profile {path} is not a qiao tuning profile: {_describe(exc)}"
        ) from None


def find_profile(
    choice: ProfileChoice, model: ModelIdentity, machine: MachineFacts | None = None
) -> tuple[Profile, Path] | None:
    """The profile to apply for `model`, and its file, or None.

    `choice`: None (use none), "auto" (this model's and machine's, if `qiao tune` wrote one) or
    a file. A profile for another machine or qiao is ignored with a warning; a given file for
    another model is applied, with a warning, since it was asked for.
    """
    if choice is None:
        return None
    machine = machine or MachineFacts.current()
    explicit = choice != "auto"
    path = Path(choice).expanduser() if explicit else profile_path(model, machine)
    if not explicit and not path.is_file():
        return None
    profile = _read_applicable(path, machine)
    if profile is None:
        return None
    if profile.model != model:
        logger.warning(
            "tuning profile %s was measured for %s, applied to %s as asked",
            path,
            profile.model.describe(),
            model.describe(),
        )
    return profile, path


def _read_applicable(path: Path, machine: MachineFacts) -> Profile | None:
    """The profile in `path`, or None (with a warning) when it is for another qiao or machine."""
    data = _read_json(path)
    why_not = foreign_reason(data)
    profile = None
    if why_not is None:
        profile = _validate(data, path)
        why_not = profile.mismatch(machine)
    if why_not is not None:
        logger.warning("tuning profile %s ignored: %s; rerun `qiao tune`", path, why_not)
        return None
    return profile


def profile_defaults(profile: Profile, given: Mapping[str, Any], block_size: int) -> dict[str, int]:
    """The profile's settings for those `given` leaves unset (a None value is unset); what is
    given explicitly wins.

    `num_kv_blocks` is rescaled to `block_size` (the pool keeps its size in tokens) and left to
    the engine when the KV cache size is given another way (`kv_cache_memory`); the token
    budget is left to the engine without chunked prefill, which needs a whole prompt per step.
    """
    explicit = {name for name, value in given.items() if value is not None}
    values = profile.settings.model_dump()
    values["num_kv_blocks"] = max(1, values["num_kv_blocks"] * profile.block_size // block_size)
    if "kv_cache_memory" in explicit:
        del values["num_kv_blocks"]
    if given.get("enable_chunked_prefill") is False:
        del values["max_num_batched_tokens"]
    return {name: value for name, value in values.items() if name not in explicit}


def cpu_model() -> str:
    """The CPU's marketing name (cpuinfo's "model name"; `platform` where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int]) -> int:
    """Distinct (package, core) pairs behind `cpus`: SMT siblings count once."""
    cores = _core_of_cpu()
    if not cores:
        return len(cpus)
    return len({cores.get(cpu, (-1, cpu)) for cpu in cpus})


@functools.cache
def _core_of_cpu() -> dict[int, tuple[int, int]]:
    # cpuinfo stanzas read "processor : 3", ..., "physical id : 0", ..., "core id : 1".
    cores: dict[int, tuple[int, int]] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return cores
    for stanza in text.split("\n\n"):
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in stanza.splitlines())
        )
        if "processor" in fields and "core id" in fields:
            package = int(fields.get("physical id", "0"))
            cores[int(fields["processor"])] = (package, int(fields["core id"]))
    return cores


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)
