"""`qiao serve` settings: one pydantic-settings schema for CLI flags, `QIAO_*` env and a file.

Precedence, highest first: command-line flags, environment variables (`QIAO_PORT=9000`), the
config file (`--config serve.json|.toml|.yaml`, or `QIAO_CONFIG`), defaults. `qiao serve --help`
lists every flag with its description and default.
"""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, create_model, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    CliToggleFlag,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from qiao.errors import ConfigError
from qiao.settings_schema import profile_choice, pydantic_fields, read_settings_file, tristate_value

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "qiao"


# The engine settings, declared once in qiao/settings_schema.py for every entry point.
_EngineFields: Any = create_model(
    "_EngineFields",
    __base__=BaseSettings,
    __module__=__name__,
    **pydantic_fields(notes={"model": "default: the built-in demo model"}),
)


class ServeSettings(_EngineFields):
    model_config = SettingsConfigDict(
        env_prefix="QIAO_",
        cli_kebab_case=True,
        cli_prog_name="qiao serve",
        cli_implicit_flags=True,
        cli_avoid_json=True,
        extra="forbid",
        validate_default=True,
    )

    # --- model and engine: the fields above (qiao/settings_schema.py), and these ---------------
    served_model_name: str | None = Field(
        None, description="model id clients send (default: directory name)"
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="run N engine replicas of the LLM (each its own process, pinned to its "
        "share of this process's cores, or on CUDA to cuda:i) behind one router: least loaded, "
        "with prefix affinity (--prefix-affinity-tokens)",
    )
    prefix_affinity_tokens: int = Field(
        64,
        ge=0,
        description="with --data-parallel-size > 1: prompts of at least this many tokens go to "
        "the replica their first this-many tokens hash to (its prefix cache), unless it holds 8 "
        "more requests than the least loaded; 0: least loaded only",
    )
    embedding_precision: Literal["fp32", "bf16", "int8"] = Field(
        "fp32",
        description="precision of the built-in embedding model: fp32; bf16 (bfloat16 weights "
        "and matmuls); int8 (W8A8 linear layers: int8 weights and per-token int8 activations, "
        "the rest float32; CPU only). A model repository's encoders: precision_mode in "
        "config.yaml",
    )
    embedding_target_p99_ms: float | None = Field(
        None,
        gt=0,
        description="adaptive batching of the built-in embedding model: its queue delay (at "
        "most 2 ms) moves to hold the p99 request latency at this many milliseconds (a model "
        "repository's encoders: dynamic_batching.target_p99_ms in config.yaml); default: off",
    )
    # --- replicas on Ray Serve (qiao[ray]) ------------------------------------------------------
    ray: str | None = Field(
        None,
        description="run each LLM version as a Ray Serve application of --replicas engine "
        "replicas behind this server (least loaded, prefix affinity, replaced when they die); "
        "ADDRESS: a cluster for ray.init (auto, HOST:6379, ray://HOST:10001); bare --ray or "
        "'local': RAY_ADDRESS, a running local cluster, else a new one on 127.0.0.1",
    )
    replicas: int = Field(1, ge=1, description="with --ray: engine replicas per LLM version")
    ray_max_replicas: int | None = Field(
        None,
        ge=1,
        description="with --ray: autoscale between --ray-min-replicas and this many replicas "
        "on API requests in flight per replica (Ray Serve's autoscaler)",
    )
    ray_min_replicas: int = Field(1, ge=1, description="with --ray-max-replicas: the fewest")
    ray_target_ongoing_requests: float = Field(
        4.0, gt=0, description="with --ray-max-replicas: API requests per replica to aim at"
    )
    ray_upscale_delay: float = Field(
        30.0, ge=0, description="with --ray-max-replicas: seconds of need before adding one"
    )
    ray_downscale_delay: float = Field(
        600.0, ge=0, description="with --ray-max-replicas: seconds idle before removing one"
    )
    ray_max_ongoing_requests: int = Field(
        256, ge=1, description="with --ray: API requests one replica holds; more wait in Ray"
    )
    ray_max_queued_requests: int = Field(
        1024, ge=1, description="with --ray: requests waiting for a replica; more get 503"
    )
    ray_replica_cpus: float = Field(
        1.0, gt=0, description="with --ray: Ray CPUs per replica (its torch threads, rounded)"
    )
    ray_replica_gpus: float = Field(0.0, ge=0, description="with --ray: Ray GPUs per replica")
    ray_no_retry: CliToggleFlag[bool] = Field(
        False,
        description="with --ray: a replica's death fails its requests with 503 "
        "engine_restarted even before their first token (default: those go to another replica)",
    )
    ray_health_check_period: float = Field(
        2.0, gt=0, description="with --ray: seconds between Ray Serve's replica health checks"
    )

    # --- model repository ------------------------------------------------------------------------
    model_repository: str | None = Field(
        None,
        description="serve a model repository DIR/<model>/<version>/ (instead of --model): a "
        "local folder, or an fsspec URL (s3://bucket/repo, gs://..., memory://...) whose "
        "versions are copied into --repository-cache-dir before they load",
    )
    repository_cache_dir: Path | None = Field(
        None,
        description="where versions of a remote --model-repository are copied (one folder per "
        "repository URL; `qiao repository gc` cleans it; default <data-dir>/repository-cache)",
    )
    repository_cache_gc_days: float | None = Field(
        None,
        ge=0,
        description="with a remote --model-repository: after a scan (at most hourly), remove "
        "its cached copies no longer served or unused for this many days, as `qiao repository "
        "gc --unused-days` does (default: off)",
    )
    model_control_mode: Literal["none", "poll", "explicit"] = Field(
        "none",
        description="none: load all at start; poll: also rescan every --repository-poll-interval;"
        " explicit: load/unload through the management API only",
    )
    repository_poll_interval: float = Field(
        5.0, gt=0, description="seconds between repository rescans (poll mode)"
    )
    load_model: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="model to load at start in explicit mode (repeatable)"
    )
    management_port: int | None = Field(
        None, ge=0, le=65535, description="serve the management API on this port (default: off)"
    )
    management_host: str = Field("127.0.0.1", description="management API bind address")
    management_token: str | None = Field(
        None, description="bearer token the management API requires (or --management-token-file)"
    )
    management_token_file: Path | None = Field(
        None, description="file holding the management API token"
    )
    grpc_port: int | None = Field(
        None, ge=0, le=65535, description="serve KServe v2 over gRPC on this port (default: off)"
    )

    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "none"] = Field(
        "auto",
        description="how tool calls are read from chat output when a request has tools: hermes "
        "(<tool_call> JSON: Qwen2.5, Qwen3), llama3_json (Llama 3.x JSON), mistral "
        "([TOOL_CALLS]), none (output stays content); auto: the family the chat template "
        "writes, else none",
    )

    # --- network and security ----------------------------------------------------------------
    host: str = Field("127.0.0.1", description="bind address (non-loopback needs an API key)")
    port: int = Field(8000, ge=0, le=65535, description="bind port (0 = any free port)")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted API key (repeatable; env: comma-separated)"
    )
    api_key_file: Path | None = Field(None, description="file with one accepted API key per line")
    keys_file: Path | None = Field(
        None,
        description="YAML file of named API keys with model lists, requests / tokens per minute, "
        "concurrency and priority ceilings (reloaded on change; format in docs/operations.md)",
    )
    rate_limit_storage: str = Field(
        "memory://",
        description="where per-key rate limits are counted: memory:// or redis://HOST:PORT "
        "(shared by replicas)",
    )
    allow_insecure_public_bind: bool = Field(
        False, description="allow a non-loopback bind without API key"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="allowed CORS origins (default: none)"
    )

    # --- limits and admission ------------------------------------------------------------------
    max_request_bytes: int = Field(1 << 20, ge=1024, description="largest request body accepted")
    max_tokens_limit: int | None = Field(
        None, ge=1, description="largest max_tokens a request may ask"
    )
    max_n: int = Field(8, ge=1, description="largest n (samples per prompt)")
    max_stop_sequences: int = Field(8, ge=0, description="most stop strings per request")
    max_stop_length: int = Field(128, ge=1, description="longest stop string, in characters")
    max_top_logprobs: int = Field(20, ge=0, description="largest logprobs / top_logprobs")
    max_prompts: int = Field(64, ge=1, description="most prompts in one completions request")
    max_waiting_requests: int = Field(256, ge=1, description="waiting-queue limit, in sequences")
    max_waiting_tokens: int = Field(
        262144, ge=1, description="waiting-queue limit, in prompt tokens"
    )
    default_timeout: float | None = Field(
        None, gt=0, description="deadline for requests without one (s)"
    )
    max_timeout: float | None = Field(
        None, gt=0, description="largest per-request timeout accepted (s)"
    )

    # --- files and batches ---------------------------------------------------------------------
    data_dir: Path = Field(
        default_factory=lambda: default_data_dir(),
        description="where /v1/files keeps uploads (SQLite + contents; default "
        "$XDG_DATA_HOME/qiao, else ~/.local/share/qiao); created on first use",
    )
    max_file_bytes: int = Field(
        200 * 1000 * 1000, ge=1024, description="largest upload to POST /v1/files, in bytes"
    )
    webhook_url: str | None = Field(
        None, description="POST every batch's end event here (Standard Webhooks)"
    )
    webhook_secret: str | None = Field(
        None, description="whsec_<base64> key that signs webhook deliveries"
    )
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts (host or host:port) a batch's metadata.webhook_url may name "
        "(repeatable; env: comma-separated; default: none)",
    )
    webhook_max_attempts: int = Field(5, ge=1, description="deliveries tried per event")
    webhook_retry_base: float = Field(
        1.0, gt=0, description="seconds before the first retry, doubled for each next one"
    )
    batch_concurrency: int = Field(1, ge=1, description="batches run at once (/v1/batches)")
    batch_output_url: str | None = Field(
        None,
        description="fsspec URL prefix (s3://bucket/dir, gs://..., file:///dir) where every "
        "finished batch's lines are also written, atomically, as <prefix>/<batch id>/output.jsonl "
        "and errors.jsonl; the batch shows them as output_url and error_url",
    )
    batch_max_in_flight: int = Field(
        64, ge=1, description="most lines of one batch in the engine at once"
    )
    batch_priority: int = Field(
        10,
        description="engine priority of batch lines; requests at it or above are background "
        "work, queued behind online ones (smaller is more urgent; online requests default to 0)",
    )
    batch_share: float = Field(
        0.25,
        gt=0,
        le=1,
        description="while online requests run or wait, background (batch) work may add to an "
        "engine step at most this fraction of the sequences and tokens the online requests took "
        "in it (at least one of each); alone it takes the whole step",
    )
    batch_yield_window: float = Field(
        0.0,
        ge=0,
        description="seconds after the last online work during which batch work stays held to "
        "--batch-share of it, so a client sending requests back to back meets short engine "
        "steps (its first token waits less) at the cost of the batch's speed; 0: only while "
        "online requests run or wait",
    )

    # --- operations ----------------------------------------------------------------------------
    stall_timeout: float = Field(
        30.0,
        gt=0,
        description="readiness fails after this long without a step with work queued (s); an "
        "engine process is then killed and restarted",
    )
    breaker_failures: int = Field(
        5,
        ge=0,
        description="engine failures within --breaker-window that open a model version's "
        "circuit breaker (its requests then get 503 at once); 0 = never",
    )
    breaker_window: float = Field(30.0, gt=0, description="circuit breaker failure window (s)")
    breaker_cooldown: float = Field(
        10.0, gt=0, description="seconds an open breaker refuses before one probe request"
    )
    max_engine_memory: float | None = Field(
        None,
        gt=0,
        description="the most memory one LLM engine may hold, weights + KV cache: bytes, or a "
        "share of RAM (<= 1); an engine over it does not start (default: no bound)",
    )
    in_process_engine: bool = Field(
        False,
        description="run the LLM engine as a thread of the server process, not in its own "
        "supervised process (no restart when it fails; for debugging and tests)",
    )
    drain_timeout: float = Field(
        30.0, ge=0, description="on SIGTERM, time given to in-flight requests (s)"
    )
    log_interval: float = Field(
        10.0, ge=0, description="seconds between throughput log lines (0 = off)"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text, or json: one JSON object per line (ts, level, logger, process, "
        "message, request_id; the access log's route, status, latency_ms, tokens and key as "
        "fields), in the engine and encoder processes too",
    )
    access_log: bool = Field(
        True,
        description="log one line per HTTP request: client, method, path, route, status, "
        "milliseconds, tokens, API key name and X-Request-Id (health probes and metric scrapes "
        "at debug level)",
    )
    metrics_vllm_names: bool = Field(
        False,
        description="export the LLM series on /metrics under vLLM's names too "
        "(vllm:num_requests_running, vllm:time_to_first_token_seconds, ...; labels model_name, "
        "version), so a stock vLLM Grafana dashboard works unchanged",
    )
    # --- response cache (qiao/api/response_cache.py) -------------------------------------------
    response_cache: bool = Field(
        False,
        description="answer repeated deterministic requests (greedy or seeded completions and "
        "chat, embeddings, KServe infers) from a cache of whole responses; header X-Qiao-Cache "
        "says hit, miss or skip; a request's `cache: false` skips it (default: off)",
    )
    response_cache_max_bytes: int = Field(
        256 << 20, ge=1024, description="with --response-cache: most bytes the memory cache holds"
    )
    response_cache_max_entries: int = Field(
        100_000, ge=1, description="with --response-cache: most entries the memory cache holds"
    )
    response_cache_ttl: float = Field(
        600.0, gt=0, description="with --response-cache: seconds an entry lives"
    )
    response_cache_backend: str = Field(
        "memory",
        description="with --response-cache: memory (this process, LRU) or redis://HOST:PORT/DB "
        "(shared by replicas; bound its memory with maxmemory and allkeys-lru)",
    )
    response_cache_scope: Literal["key", "shared"] = Field(
        "key",
        description="with --response-cache: key: entries per API key (one key never sees "
        "another's answers); shared: one cache for every key",
    )
    response_cache_namespace: str = Field(
        "qiao",
        min_length=1,
        description="with a redis backend: prefix of this deployment's keys (replicas that "
        "share answers share it)",
    )
    config: Path | None = Field(None, description="settings file (.json, .toml, .yaml)")

    @field_validator(
        "api_key", "cors_origins", "load_model", "webhook_allowed_hosts", mode="before"
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("response_cache_backend")
    @classmethod
    def _known_cache_backend(cls, value: str) -> str:
        if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must be memory or a redis:// (rediss://, unix://) URL")
        return value

    @field_validator("model_repository", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        # A folder may be given as a Path (it was a Path field before URLs were allowed).
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @model_validator(mode="after")
    def _one_model_source(self) -> ServeSettings:
        if self.model is not None and self.model_repository is not None:
            raise ValueError("model and model-repository exclude each other")
        if self.load_model and self.model_control_mode != "explicit":
            raise ValueError("load-model needs --model-control-mode explicit")
        return self

    @field_validator("batch_output_url")
    @classmethod
    def _known_protocol(cls, value: str | None) -> str | None:
        if value is not None:
            import fsspec

            try:
                fsspec.core.url_to_fs(value)
            except (ImportError, ValueError) as exc:
                raise ValueError(f"cannot write to {value}: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _ray_alone(self) -> ServeSettings:
        if self.ray is not None and self.data_parallel_size > 1:
            raise ValueError("ray and data-parallel-size > 1 exclude each other (use --replicas)")
        if self.ray is not None and self.in_process_engine:
            raise ValueError("ray and in-process-engine exclude each other")
        if self.ray_max_replicas is not None and self.ray_min_replicas > self.ray_max_replicas:
            raise ValueError("ray-min-replicas must not exceed ray-max-replicas")
        return self

    def ray_options(self) -> Any:
        """The `RayOptions` of these settings, or None without --ray."""
        if self.ray is None:
            return None
        from qiao.engine.ray_replicas import RayOptions

        return RayOptions(
            address=self.ray or "local",
            replicas=self.replicas,
            min_replicas=self.ray_min_replicas,
            max_replicas=self.ray_max_replicas,
            target_ongoing_requests=self.ray_target_ongoing_requests,
            upscale_delay=self.ray_upscale_delay,
            downscale_delay=self.ray_downscale_delay,
            max_ongoing_requests=self.ray_max_ongoing_requests,
            max_queued_requests=self.ray_max_queued_requests,
            replica_cpus=self.ray_replica_cpus,
            replica_gpus=self.ray_replica_gpus,
            retry=not self.ray_no_retry,
            health_check_period=self.ray_health_check_period,
            affinity_tokens=self.prefix_affinity_tokens,
        )

    @model_validator(mode="after")
    def _one_choice_each(self) -> ServeSettings:
        if self.profile is not None and self.no_profile:
            raise ValueError("profile and no-profile exclude each other")
        for name in ("cuda_graphs", "batch_invariant"):
            if getattr(self, name) and getattr(self, "no_" + name):
                raise ValueError(f"{name} and no-{name} exclude each other".replace("_", "-"))
        return self

    @property
    def cuda_graphs_choice(self) -> bool | None:
        """`EngineConfig.cuda_graphs`: True, False, or None (the device's default)."""
        return tristate_value(self, "cuda_graphs")

    @property
    def batch_invariant_choice(self) -> bool:
        """Batch invariance is off in the server unless asked for."""
        return bool(tristate_value(self, "batch_invariant"))

    @property
    def profile_choice(self) -> str | None:
        """The tuning profile to use: a file, "auto" (this model's, if any), or None."""
        return profile_choice({"profile": self.profile, "no_profile": self.no_profile})

    @property
    def model_path(self) -> str:
        return self.model or str(DEMO_MODEL_DIR)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def api_keys(self) -> list[str]:
        """Every accepted API key, from --api-key / QIAO_API_KEY / the config file and the key
        file. Raises ConfigError for a key that is empty, short or not sendable in a header."""
        keys = [("api_key", key) for key in self.api_key]
        if self.api_key_file is not None:
            try:
                lines = self.api_key_file.read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"api_key_file cannot be read ({exc.strerror})") from exc
            keys += [
                ("api_key_file", line.strip())
                for line in lines
                if line.strip() and not line.startswith("#")
            ]
        for index, (source, key) in enumerate(keys, 1):
            check_secret(key, f"{source} (key {index})")
        return [key for _, key in keys]

    def management_token_value(self) -> str | None:
        if self.management_token_file is not None:
            try:
                token = self.management_token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"management_token_file cannot be read ({exc.strerror})") from exc
            return token or None
        return self.management_token

    def is_loopback_bind(self, host: str | None = None) -> bool:
        host = self.host if host is None else host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def check_security(self) -> None:
        """Refuse empty or weak secrets, and a public bind without an API key unless explicitly
        told it is fine."""
        api_keys = self.api_keys()  # checks every key, whatever the bind
        if self.webhook_secret is not None:
            from qiao.api.webhooks import secret_key

            secret_key(self.webhook_secret)
        if self.keys_file is not None:
            from qiao.api.keys import load_keys_file

            api_keys += [key.name for key in load_keys_file(self.keys_file)]
        if not self.is_loopback_bind() and not api_keys and not self.allow_insecure_public_bind:
            raise ConfigError(
                f"host {self.host!r} is not a loopback address and no API key is set: pass "
                "--api-key (or QIAO_API_KEY / --api-key-file), or --allow-insecure-public-bind"
            )
        if self.management_port is not None:
            token = self.management_token_value()
            if not token or len(token) < MIN_SECRET_LENGTH:
                raise ConfigError(
                    f"management_port needs a token of at least {MIN_SECRET_LENGTH} characters: "
                    "pass --management-token (or QIAO_MANAGEMENT_TOKEN / --management-token-file)"
                )
            check_secret(token, "management_token")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # CLI values arrive through init; the file is passed in as the lowest-priority source.
        return (init_settings, env_settings, _FileSource(settings_cls))


# The shortest API key or management token accepted: a guessable secret is no secret.
MIN_SECRET_LENGTH = 16


def check_secret(secret: str, what: str) -> None:
    """Refuse a secret that is short, or that a client cannot send as `Bearer <secret>` (the
    secret itself is never part of the message)."""
    if len(secret) < MIN_SECRET_LENGTH:
        got = "an empty one" if not secret else f"one of {len(secret)}"
        raise ConfigError(
            f"{what}: an API key or token needs at least {MIN_SECRET_LENGTH} characters, got "
            f"{got}; generate one with `python -c 'import secrets; print(secrets.token_urlsafe())'`"
        )
    if not all(33 <= ord(c) < 127 for c in secret):
        raise ConfigError(
            f"{what}: an API key or token must be printable ASCII without spaces (it is sent in "
            "the Authorization header)"
        )


_FILE_VALUES: dict[str, Any] = {}


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_VALUES)


def read_config_file(path: Path) -> dict[str, Any]:
    """Settings from a JSON, TOML or YAML file; keys use snake_case or kebab-case."""
    values = read_settings_file(path)
    unknown = sorted(set(values) - set(ServeSettings.model_fields))
    if unknown:
        raise ConfigError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return values


def load_settings(argv: Sequence[str]) -> ServeSettings:
    """Parse `qiao serve` arguments (plus env and config file) into validated settings."""
    config_path = _find_config_path(argv)
    _FILE_VALUES.clear()
    if config_path is not None:
        _FILE_VALUES.update(read_config_file(config_path))
    try:
        cli = CliSettingsSource(ServeSettings, cli_parse_args=_bare_ray(argv))
        return ServeSettings(_cli_settings_source=cli)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    finally:
        # The file belongs to this call: settings built later (ServeSettings()) must not see it.
        _FILE_VALUES.clear()


def _bare_ray(argv: Sequence[str]) -> list[str]:
    """`--ray` with no address (last, or before another flag) means `--ray local`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--ray" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out.insert(i + 1, "local")
            break
    return out


def _find_config_path(argv: Sequence[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    env = os.environ.get("QIAO_CONFIG")
    return Path(env) if env else None


def _describe(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        name = ".".join(str(p) for p in error["loc"]) or "settings"
        parts.append(f"{name.replace('_', '-')}: {error['msg']}")
    return "invalid settings: " + "; ".join(parts)


if __name__ == "__main__":  # pragma: no cover - manual check of the parser
    print(load_settings(sys.argv[1:]))
