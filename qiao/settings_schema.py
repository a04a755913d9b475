"""The engine settings, declared once for every entry point.

Each `Setting` below is an engine setting (what `LLM(...)` and `EngineConfig.create` take). From
this one table come:

- the `argparse` flags of `qiao generate`, `qiao batch run`, `qiao bench throughput|latency|
  quality` and `qiao tune` (`add_engine_flags`), with their `--help` lines;
- the same fields of `qiao serve`'s pydantic-settings schema (`pydantic_fields`), so its flags,
  its `QIAO_*` environment variables and its config file keys are these;
- `QIAO_*` environment variables and `--config FILE` keys for the argparse commands too
  (`resolve_engine_flags`: flag > environment > config file > default);
- the checks `LLM(...)` applies to its keyword arguments (`check_engine_kwargs`).

Flag spelling follows vLLM's where the setting means the same (`--enable-prefix-caching` /
`--no-enable-prefix-caching`). A setting has one of four kinds: a value (`--dtype bfloat16`), a
switch with both spellings (`--enable-chunked-prefill` / `--no-enable-chunked-prefill`), a
three-way switch whose absence means "the default of where it runs" (`--cuda-graphs` /
`--no-cuda-graphs`, else None), and a plain flag (`--no-profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from qiao.errors import ConfigError

Kind = Literal["value", "switch", "tristate", "flag"]
ENV_PREFIX = "QIAO_"


@dataclass(frozen=True)
class Setting:
    """One engine setting: its name (the keyword argument, `--kebab-flag`, `QIAO_UPPER` env
    var and config key), type, default and help line."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None
    kind: Kind = "value"
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive
    maximum: float | None = None  # inclusive
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def check(self, value: Any, source: str) -> Any:
        """`value` converted and checked; ConfigError naming `source` when it is not valid."""
        if value is None or (
            self.default is None and isinstance(value, str) and value.lower() == "none"
        ):
            return None
        if self.kind != "value":
            return _as_bool(value, source)
        try:
            value = self.type(value) if isinstance(value, str) else value
            if self.type is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if self.type in (int, float) and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise ValueError
        except (TypeError, ValueError):
            kind = getattr(self.type, "__name__", "value")
            raise ConfigError(f"{source}: expected {kind}, got {value!r}") from None
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{source}: must be one of {', '.join(self.choices)}, got {value!r}")
        for bound, ok, words in (
            (self.minimum, lambda b: value >= b, "at least"),
            (self.above, lambda b: value > b, "above"),
            (self.maximum, lambda b: value <= b, "at most"),
        ):
            if bound is not None and not ok(bound):
                raise ConfigError(f"{source}: must be {words} {bound:g}, got {value!r}")
        return value


def _as_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{source}: expected true or false, got {value!r}")


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

ENGINE_SETTINGS: tuple[Setting, ...] = (
    Setting("model", "Hugging Face checkpoint directory, or a .gguf file", metavar="PATH"),
    Setting(
        "dtype",
        "weight and activation dtype (auto: the checkpoint's; on the CPU a half-precision "
        "checkpoint runs in bfloat16 where the CPU has AMX or AVX-512 BF16, else float32)",
        default="auto",
        choices=DTYPE_CHOICES,
    ),
    Setting(
        "load_format",
        "weight source (dummy: random weights of the right shapes, no checkpoint needed; "
        "gguf: a llama.cpp .gguf file, also picked by auto for a .gguf path)",
        default="auto",
        choices=("auto", "safetensors", "gguf", "dummy"),
    ),
    Setting(
        "quantization",
        "int8: weight-only int8 linear layers (a quarter of float32's bytes); w8a8: int8 "
        "weights and per-token int8 activations, int8 matmuls (AVX-512 VNNI); int4: group-wise "
        "4-bit weights (implied by an AWQ or GPTQ checkpoint)",
        choices=("int8", "w8a8", "int4"),
    ),
    Setting(
        "max_model_len", "context length limit (default: the checkpoint's)", type=int, minimum=1
    ),
    Setting(
        "max_num_seqs",
        "max running sequences per step (default: the tuning profile's, else 128)",
        type=int,
        minimum=1,
    ),
    Setting(
        "max_num_batched_tokens",
        "token budget per engine step (default: the tuning profile's, else 2048)",
        type=int,
        minimum=1,
    ),
    Setting(
        "enable_chunked_prefill", "split long prompts across steps", default=True, kind="switch"
    ),
    Setting(
        "enable_prefix_caching", "reuse KV blocks of shared prefixes", default=True, kind="switch"
    ),
    Setting(
        "batch_invariant",
        "compute every token the same whatever else its step holds, so greedy output does not "
        "depend on the batch (CPU; matmuls in 32-row tiles, about 4% slower; default: on for "
        "`qiao batch run`, off elsewhere)",
        kind="tristate",
    ),
    Setting("block_size", "tokens per KV block", type=int, default=16, minimum=1),
    Setting(
        "kv_cache_memory",
        "KV cache size: bytes (> 1) or a share of device memory (<= 1)",
        type=float,
        above=0,
    ),
    Setting(
        "num_kv_blocks",
        "KV pool size in blocks (overrides --kv-cache-memory; default: the tuning profile's)",
        type=int,
        minimum=1,
    ),
    Setting(
        "kv_cache_dtype",
        "KV cache storage dtype (auto: the weights'; bfloat16 under float32 weights halves "
        "attention's reads and the pool's bytes per token)",
        default="auto",
        choices=DTYPE_CHOICES,
    ),
    Setting(
        "prefix_cache_reserve",
        "share of the KV pool freed blocks may fill (prefix cache) before unused blocks are "
        "touched; lower keeps the memory touched near the load (1.0: the whole pool)",
        type=float,
        default=1.0,
        minimum=0.0,
        maximum=1.0,
    ),
    Setting(
        "scheduling_policy", "waiting-queue order", default="fcfs", choices=("fcfs", "priority")
    ),
    Setting(
        "target_itl_ms",
        "adaptive batching: move the step token budget (within --adaptive-min-batched-tokens "
        "and --max-num-batched-tokens, starting from the tuning profile's) to hold the time of "
        "decode steps, the inter-token latency, at this many milliseconds (default: off)",
        type=float,
        above=0,
    ),
    Setting(
        "target_itl_tolerance",
        "adaptive batching: the dead band around --target-itl-ms, a share of it",
        type=float,
        default=0.2,
        minimum=0.0,
        maximum=0.95,
    ),
    Setting(
        "adaptive_min_batched_tokens",
        "adaptive batching: the smallest step token budget it may choose",
        type=int,
        default=32,
        minimum=1,
    ),
    Setting(
        "seed",
        "engine seed for requests without their own (benchmarks: also of their prompts and "
        "arrivals)",
        type=int,
        default=0,
    ),
    Setting("device", "auto | cpu | cuda | cuda:N", default="auto"),
    Setting(
        "tensor_parallel_size",
        "split the model over N ranks (torch.distributed: gloo on the CPU, NCCL on CUDA; one "
        "worker process per extra rank; heads, KV heads and MLP width must divide by N)",
        type=int,
        default=1,
        minimum=1,
    ),
    Setting(
        "cuda_graphs",
        "replay CUDA graphs for decode steps (default: on for CUDA, off elsewhere)",
        kind="tristate",
    ),
    Setting(
        "speculative_method",
        "speculative decoding: ngram (prompt lookup: propose the tokens that followed the last "
        "n tokens' latest earlier occurrence) or draft (the greedy tokens of the smaller "
        "--speculative-model); verified exactly, output unchanged",
        choices=("ngram", "draft"),
    ),
    Setting(
        "speculative_model",
        "draft: the draft checkpoint directory (same vocabulary as the model)",
        metavar="PATH",
    ),
    Setting(
        "num_speculative_tokens",
        "tokens proposed and verified per decode step (with --speculative-method)",
        type=int,
        default=4,
        minimum=1,
    ),
    Setting(
        "prompt_lookup_min",
        "ngram: the shortest suffix looked up in the prompt and output",
        type=int,
        default=2,
        minimum=1,
    ),
    Setting(
        "prompt_lookup_max",
        "ngram: the longest suffix looked up (tried first)",
        type=int,
        default=4,
        minimum=1,
    ),
    Setting(
        "enable_lora",
        "serve PEFT LoRA adapters, chosen per request (docs/lora.md)",
        default=False,
        kind="switch",
    ),
    Setting(
        "max_loras", "adapters computed in one step (device slots)", type=int, default=1, minimum=1
    ),
    Setting("max_lora_rank", "the largest adapter rank accepted", type=int, default=16, minimum=1),
    Setting(
        "max_cpu_loras",
        "adapters kept loaded on the CPU, least recently used dropped (default: max_loras)",
        type=int,
        minimum=1,
    ),
    Setting(
        "lora_modules",
        "adapters loaded at start: name=path entries (space- or comma-separated), or JSON "
        '({"name": ..., "path": ...} or a list of them)',
        metavar="NAME=PATH",
    ),
    Setting(
        "num_threads",
        "torch CPU threads (default: the tuning profile's, else torch's)",
        type=int,
        minimum=1,
    ),
    Setting(
        "profile",
        "tuning profile file (default: this model's from `qiao tune`, if any)",
        metavar="PATH",
    ),
    Setting("no_profile", "use no tuning profile", default=False, kind="flag"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in ENGINE_SETTINGS}

# What the engine-running commands take, in --help order.
GENERATE_SETTINGS = tuple(
    n
    for n in BY_NAME
    if n
    not in (
        "enable_chunked_prefill",
        "block_size",
        "prefix_cache_reserve",
        "scheduling_policy",
        # Adapters are chosen per request: the server's and LLM.generate's.
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
        "lora_modules",
    )
)
BENCH_SETTINGS = (
    "dtype",
    "load_format",
    "quantization",
    "kv_cache_dtype",
    "device",
    "cuda_graphs",
    "seed",
)

# Marks an argparse action made from this table (tests/test_settings_schema.py checks it).
SCHEMA_ATTRIBUTE = "qiao_setting"


def add_engine_flags(
    container: argparse._ActionsContainer,
    names: Iterable[str],
    *,
    defaults: Mapping[str, Any] | None = None,
    required: Iterable[str] = (),
    notes: Mapping[str, str] | None = None,
    config_flag: bool = True,
    from_env: bool = True,
) -> None:
    """Add the flags of the settings `names` to a parser, group or mutually exclusive group.

    `defaults` changes a setting's default for this command (shown in --help); `required`
    settings must be given (as a flag, env var or config key). Parsed values are resolved by
    `resolve_engine_flags`, which the `qiao` command line calls for every command. `notes`
    adds a word to a setting's help for this command (what its unset default means there).
    `from_env=False`: these flags take no environment variable or config key (a flag in a
    mutually exclusive group, which a value from the environment would break).
    """
    defaults = dict(defaults or {})
    required = set(required)
    names = list(names)
    for name in names:
        setting = BY_NAME[name]
        default = defaults.get(name, setting.default)
        help_text = setting.help
        if notes and name in notes:
            help_text += f" ({notes[name]})"
        if name in required:
            help_text += " (required)"
        elif setting.kind in ("value", "switch") and default is not None:
            help_text += f" (default {default})"
        help_text = help_text.replace("%", "%%") + (f"; env {setting.env}" if from_env else "")
        kwargs: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
        if setting.kind == "value":
            choices = setting.choices
            if choices is not None and setting.default is None:
                choices = (*choices, "none")  # an optional setting can be unset again
            kwargs.update(metavar=setting.metavar, choices=choices)
        elif setting.kind in ("switch", "tristate"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_true"
        action = container.add_argument(setting.flag, **kwargs)
        setattr(action, SCHEMA_ATTRIBUTE, name)
    if config_flag:
        action = container.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            metavar="FILE",
            help="settings file (.json, .toml, .yaml) whose engine keys apply here too; env "
            f"{ENV_PREFIX}CONFIG",
        )
        setattr(action, SCHEMA_ATTRIBUTE, "config")
    # A group has no set_defaults of its own; its parser's is the one parse_args reads.
    owner = getattr(container, "_qiao_parser", container)
    if not isinstance(owner, argparse.ArgumentParser):
        raise TypeError("pass the parser (or a group made by engine_group)")
    if not from_env:
        owner.set_defaults(**{name: defaults.get(name, BY_NAME[name].default) for name in names})
        return
    # Several calls on one parser add up.
    owner.set_defaults(
        _engine_settings=[*(owner.get_default("_engine_settings") or []), *names],
        _engine_defaults={**(owner.get_default("_engine_defaults") or {}), **defaults},
        _engine_required=sorted({*(owner.get_default("_engine_required") or []), *required}),
    )


def engine_group(parser: argparse.ArgumentParser, title: str = "engine") -> Any:
    """An argument group of `parser` that `add_engine_flags` can add to."""
    group = parser.add_argument_group(title)
    group._qiao_parser = parser  # type: ignore[attr-defined]
    return group


def exclusive_group(group: Any, *, required: bool = False) -> Any:
    """A mutually exclusive group inside an `engine_group` (e.g. --model | --shape)."""
    exclusive = group.add_mutually_exclusive_group(required=required)
    exclusive._qiao_parser = group._qiao_parser
    return exclusive


def resolve_engine_flags(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> None:
    """Fill in the engine settings a command declared: the flag if given, else its `QIAO_*`
    environment variable, else the config file's key (`--config` or `QIAO_CONFIG`), else the
    default. Raises ConfigError naming the source of a value that is not valid."""
    names = getattr(args, "_engine_settings", None)
    if names is None:
        return
    environ = os.environ if environ is None else environ
    defaults = args._engine_defaults
    config_path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    config = read_settings_file(Path(config_path)) if config_path else {}
    for name in names:
        setting = BY_NAME[name]
        if name in vars(args):
            value = setting.check(getattr(args, name), setting.flag)
        elif setting.env in environ:
            value = setting.check(environ[setting.env], setting.env)
        elif name in config:
            value = setting.check(config[name], f"{config_path}: {name}")
        else:
            value = defaults.get(name, setting.default)
        setattr(args, name, value)
    missing = [BY_NAME[n].flag for n in args._engine_required if getattr(args, n) is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or its {ENV_PREFIX}* variable)")
    for private in ("_engine_settings", "_engine_defaults", "_engine_required"):
        delattr(args, private)


def profile_choice(values: Mapping[str, Any]) -> str | None:
    """The tuning profile to use: a file, "auto" (this model's, if any), or None."""
    if values.get("no_profile"):
        if values.get("profile"):
            raise ConfigError("--profile and --no-profile exclude each other")
        return None
    return str(values["profile"]) if values.get("profile") else "auto"


def engine_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """`LLM(model, **kwargs)` keyword arguments from resolved settings (everything but
    `model`, with `profile` / `no_profile` folded into `profile`)."""
    kwargs = {
        name: values[name]
        for name in BY_NAME
        if name in values and name not in ("model", "profile", "no_profile")
    }
    kwargs["profile"] = profile_choice(values)
    if kwargs.get("batch_invariant") is None:
        kwargs.pop("batch_invariant", None)
    return kwargs


def check_engine_kwargs(kwargs: Mapping[str, Any]) -> None:
    """The checks the CLI applies to a flag, applied to `LLM(...)`'s keyword arguments."""
    for name, value in kwargs.items():
        setting = BY_NAME.get(name)
        if setting is not None and setting.kind == "value" and name != "profile":
            setting.check(value, f"LLM({name}=...)")


def read_settings_file(path: Path) -> dict[str, Any]:
    """Settings from a JSON, TOML or YAML file, keys in snake_case or kebab-case."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror})") from exc
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file {path}: use .json, .toml or .yaml")
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def pydantic_fields(
    names: Sequence[str] | None = None,
    notes: Mapping[str, str] | None = None,
    *,
    cli: bool = True,
) -> dict[str, Any]:
    """The settings as pydantic fields (`create_model(**fields)`) for `qiao serve`'s schema:
    same names, defaults, bounds and help. A three-way switch becomes two toggles (`--x` and
    `--no-x`), since a CLI toggle cannot hold None; `serve` reads them back with
    `tristate_value`. `cli=False` (a config file section): a three-way switch is one
    `bool | None` field. `notes` adds a word to a setting's help for this command (what its
    unset default means there)."""
    from pydantic import Field
    from pydantic_settings import CliToggleFlag

    fields: dict[str, Any] = {}
    for name in names or list(BY_NAME):
        s = BY_NAME[name]
        if notes and name in notes:
            s = dataclasses.replace(s, help=f"{s.help} ({notes[name]})")
        if s.kind == "tristate" and not cli:
            fields[name] = (bool | None, Field(None, description=s.help))
            continue
        if s.kind == "tristate":
            fields[name] = (CliToggleFlag[bool], Field(False, description=s.help))
            fields["no_" + name] = (
                CliToggleFlag[bool],
                Field(False, description=f"the opposite of --{name.replace('_', '-')}"),
            )
            continue
        if s.kind == "flag":
            flag = CliToggleFlag[bool] if cli else bool
            fields[name] = (flag, Field(s.default, description=s.help))
            continue
        if s.kind == "switch":
            fields[name] = (bool, Field(s.default, description=s.help))
            continue
        base: Any = s.type if s.type in (int, float) else str
        if s.choices is not None:
            base = Literal[s.choices]  # type: ignore[valid-type]
        annotation = base if s.default is not None else base | None
        bounds = {
            key: bound
            for key, bound in (("ge", s.minimum), ("gt", s.above), ("le", s.maximum))
            if bound is not None
        }
        fields[name] = (annotation, Field(s.default, description=s.help, **bounds))
    return fields


def tristate_value(values: Any, name: str) -> bool | None:
    """True, False or None (unset) from the two toggles `pydantic_fields` made for `name`."""
    on, off = getattr(values, name), getattr(values, "no_" + name)
    if on and off:
        flag = name.replace("_", "-")
        raise ConfigError(f"--{flag} and --no-{flag} exclude each other")
    return True if on else (False if off else None)
