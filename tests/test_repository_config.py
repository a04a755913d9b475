"""The per-model repository config: every key parses, YAML and JSON alike, and every unknown key
or bad value is a ConfigError naming the file and the dotted key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from qiao.config import EngineConfig
from qiao.errors import ConfigError
from qiao.repository.config import (
    ModelConfigFile,
    VersionPolicy,
    find_config_file,
    parse_model_config,
    parse_size,
    read_model_config,
    single_model_config,
)

FULL_ENCODER_YAML = """\
backend: embedding
precision_mode: fp16
max_batch_size: 32
max_sequence_length: 256
dynamic_batching:
  preferred_batch_size: [8, 4]
  max_queue_delay_microseconds: 10000
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy:
    max_queue_size: 128
    default_timeout_microseconds: 500000
    allow_timeout_override: true
hardware:
  device: cuda
  gpu_id: 1
  workspace_size: 512MiB
version_policy:
  latest:
    num_versions: 2
traffic:
  1: 90
  "2": 10
"""

FULL_LLM = {
    "backend": "llm",
    "precision_mode": "BF16",
    "hardware": {"device": "cpu", "workspace_size": "2GB"},
    "version_policy": {"specific": {"versions": [3, "1"]}},
    "traffic": {"1": 0.5, "3": 1.5},
    "llm": {
        "max_model_len": 512,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 1024,
        "enable_chunked_prefill": False,
        "enable_prefix_caching": False,
        "block_size": 32,
        "num_kv_blocks": 64,
        "kv_cache_dtype": "float16",
        "prefix_cache_reserve": 0.5,
        "quantization": "int8",
        "load_format": "dummy",
        "seed": 7,
        "scheduling_policy": "priority",
        "cuda_graphs": False,
    },
}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_every_encoder_key_parses(tmp_path: Path) -> None:
    config = read_model_config(write(tmp_path / "config.yaml", FULL_ENCODER_YAML))
    assert config.backend == "embedding"
    assert config.precision_mode == "FP16" and config.dtype_name == "float16"
    assert config.max_sequence_length == 256
    assert config.hardware.device_spec == "cuda:1"
    assert config.hardware.workspace_size == 512 * 1024 * 1024
    assert config.version_policy.kind == "latest"
    assert config.version_policy.latest is not None
    assert config.version_policy.latest.num_versions == 2
    assert config.traffic == {"1": 90.0, "2": 10.0}
    assert config.batcher_values() == {
        "max_batch_size": 32,
        "preferred_batch_sizes": (4, 8),
        "max_queue_delay_us": 10000,
        "priority_levels": 3,
        "default_priority_level": 2,
        "max_queue_size": 128,
        "default_timeout_us": 500000,
        "allow_timeout_override": True,
    }


def test_every_llm_key_reaches_the_engine_config() -> None:
    config = parse_model_config(FULL_LLM, "models/chat/config.json")
    assert config.version_policy.specific is not None
    assert config.version_policy.specific.versions == ["1", "3"]
    assert config.llm is not None and config.llm.seed == 7
    engine = EngineConfig.create("/some/checkpoint", **config.engine_kwargs())
    assert engine.model.dtype == "bfloat16"
    assert engine.model.max_model_len == 512
    assert engine.model.quantization == "int8"
    assert engine.cache.kv_cache_dtype == "float16"
    assert engine.cache.prefix_cache_reserve == 0.5
    assert engine.model.load_format == "dummy"
    assert engine.model.seed == 7
    assert engine.scheduler.max_num_seqs == 8
    assert engine.scheduler.max_num_batched_tokens == 1024
    assert engine.scheduler.enable_chunked_prefill is False
    assert engine.scheduler.policy == "priority"
    assert engine.cache.block_size == 32
    assert engine.cache.num_kv_blocks == 64
    assert engine.cache.enable_prefix_caching is False
    # workspace_size is the llm's KV-cache budget, in bytes.
    assert engine.cache.kv_cache_memory == 2e9
    assert engine.device == "cpu"
    assert engine.cuda_graphs is False


def test_llm_defaults_are_the_serve_defaults() -> None:
    from qiao.api.settings import ServeSettings
    from qiao.repository.config import LLM_SETTINGS, LLMSettings

    config = parse_model_config({"backend": "llm"}, "x")
    kwargs = config.engine_kwargs()
    serve = ServeSettings()
    # One schema (qiao/settings_schema.py): the same defaults in both.
    for name in LLM_SETTINGS:
        if name != "cuda_graphs":  # serve: two toggles, read back by cuda_graphs_choice
            assert getattr(LLMSettings(), name) == getattr(serve, name), name
    assert LLMSettings().cuda_graphs is serve.cuda_graphs_choice is None
    for name in ("block_size", "seed", "load_format"):
        assert kwargs[name] == getattr(serve, name), name
    # Left unset, the token budget and batch limit take the engine's defaults in both.
    engine = EngineConfig.create("x", **kwargs)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (128, 2048)
    assert kwargs["enable_chunked_prefill"] is serve.enable_chunked_prefill
    assert kwargs["kv_cache_memory"] is None and kwargs["device"] == "auto"
    assert kwargs["dtype"] == "float32"  # precision_mode's default, FP32


def test_yaml_and_json_are_the_same_config(tmp_path: Path) -> None:
    data = yaml.safe_load(FULL_ENCODER_YAML)
    data["traffic"] = {str(k): v for k, v in data["traffic"].items()}
    from_yaml = read_model_config(write(tmp_path / "a" / "config.yml", FULL_ENCODER_YAML))
    from_json = read_model_config(write(tmp_path / "b" / "config.json", json.dumps(data)))
    assert from_yaml == from_json


def test_defaults() -> None:
    config = parse_model_config({"backend": "onnx"}, "x")
    assert config.precision_mode == "FP32" and config.dtype_name == "float32"
    assert config.max_batch_size == 64
    assert config.dynamic_batching is None and config.traffic is None and config.llm is None
    assert config.hardware.device_spec == "auto"
    assert config.version_policy.kind == "latest"
    assert config.version_policy.select(["1", "2"]) == ["2"]
    # No dynamic_batching block: no delay, no preferred sizes, unbounded queue, no timeout.
    assert config.batcher_values() == {
        "max_batch_size": 64,
        "preferred_batch_sizes": (),
        "max_queue_delay_us": 0,
        "priority_levels": 1,
        "default_priority_level": 0,
        "max_queue_size": 0,
        "default_timeout_us": 0,
        "allow_timeout_override": False,
    }


def test_queue_policy_keys_may_sit_directly_under_dynamic_batching() -> None:
    nested = {
        "backend": "embedding",
        "dynamic_batching": {
            "preferred_batch_size": 4,
            "default_queue_policy": {"max_queue_size": 3, "default_timeout_microseconds": 9},
        },
    }
    flat = {
        "backend": "embedding",
        "dynamic_batching": {
            "preferred_batch_size": [4],
            "max_queue_size": 3,
            "default_timeout_microseconds": 9,
        },
    }
    a, b = parse_model_config(nested, "x"), parse_model_config(flat, "x")
    assert a.batcher_values() == b.batcher_values()
    assert a.batcher_values()["max_queue_size"] == 3
    assert a.batcher_values()["preferred_batch_sizes"] == (4,)


@pytest.mark.parametrize(
    ("mode", "dtype"),
    [("fp32", "float32"), ("Fp16", "float16"), ("BF16", "bfloat16"), ("auto", "auto")],
)
def test_precision_mode_names_a_dtype(mode: str, dtype: str) -> None:
    config = parse_model_config({"backend": "embedding", "precision_mode": mode}, "x")
    assert config.dtype_name == dtype


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", 3 * 2**29),
        ("1 KiB", 1024),
        ("4096", 4096),
        ("10b", 10),
        ("3kb", 3000),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1GB", "0", "0.1", "1e3MB", "1 KB B"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


# --- version policies ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # Numeric order: lexicographic order ("1", "10", "2", "3") would pick 2 and 3.
        ({"latest": {"num_versions": 2}}, ["3", "10"]),
        ({"latest": {"num_versions": 1}}, ["10"]),
        ({"latest": {}}, ["10"]),
        ({"latest": {"num_versions": 9}}, ["1", "2", "3", "10"]),
        ("all", ["1", "2", "3", "10"]),
        ({"all": {}}, ["1", "2", "3", "10"]),
        ({"all": None}, ["1", "2", "3", "10"]),
        ({"specific": {"versions": [10, 1]}}, ["1", "10"]),
        ({"specific": {"versions": ["3", 7]}}, ["3"]),
        ({}, ["10"]),
    ],
)
def test_version_policy_selects(policy: Any, expected: list[str]) -> None:
    config = parse_model_config({"backend": "onnx", "version_policy": policy}, "x")
    assert config.version_policy.select(["1", "3", "10", "2"]) == expected


def test_version_policy_default_is_latest_one() -> None:
    assert VersionPolicy.model_validate({}).select(["2", "10", "9"]) == ["10"]


# --- errors -----------------------------------------------------------------------------------

FILE = "models/embed/config.yaml"
ENC = {"backend": "embedding"}
LLM = {"backend": "llm"}


def with_(base: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return {**base, **keys}


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"backend": "embedding", "colour": "red"}, "colour: unknown key"),
        (with_(ENC, dynamic_batching={"max_batch": 3}), "dynamic_batching.max_batch: unknown key"),
        (
            with_(ENC, dynamic_batching={"default_queue_policy": {"size": 1}}),
            "dynamic_batching.default_queue_policy.size: unknown key",
        ),
        (with_(ENC, hardware={"gpu": 0}), "hardware.gpu: unknown key"),
        (
            with_(ENC, version_policy={"latest": {"n": 2}}),
            "version_policy.latest.n: unknown key",
        ),
        (with_(ENC, version_policy={"newest": {}}), "version_policy.newest: unknown key"),
        (with_(LLM, llm={"max_seqs": 4}), "llm.max_seqs: unknown key"),
        (with_(LLM, llm={"dtype": "float16"}), "llm.dtype: set precision_mode"),
        (with_(LLM, llm={"device": "cuda"}), "llm.device: set hardware.device"),
    ],
)
def test_unknown_keys_are_named(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_model_config(data, FILE)
    assert str(error.value).startswith(f"{FILE}: ")
    assert key in str(error.value)


def test_an_unknown_key_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="allowed: device, gpu_id, workspace_size"):
        parse_model_config(with_(ENC, hardware={"gpu": 0}), FILE)


BAD_VALUES = [
    ({}, "backend: Field required"),
    ({"backend": "tensorflow"}, "backend: Input should be 'llm', 'embedding' or 'onnx'"),
    (with_(ENC, precision_mode="FP8"), "precision_mode:"),
    (with_(ENC, precision_mode=16), "precision_mode:"),
    (with_(ENC, max_batch_size=0), "max_batch_size: Input should be greater than or equal to 1"),
    (with_(ENC, max_batch_size="64"), "max_batch_size: Input should be a valid integer"),
    (with_(ENC, max_batch_size=True), "max_batch_size: Input should be a valid integer"),
    (with_(ENC, max_batch_size=2.5), "max_batch_size:"),
    (with_(ENC, max_sequence_length=0), "max_sequence_length:"),
    (with_(ENC, dynamic_batching=[4, 8]), "dynamic_batching:"),
    (with_(ENC, dynamic_batching={"preferred_batch_size": [0]}), "preferred_batch_size:"),
    (with_(ENC, dynamic_batching={"preferred_batch_size": [4, 4]}), "preferred_batch_size:"),
    (with_(ENC, dynamic_batching={"preferred_batch_size": "4"}), "preferred_batch_size:"),
    (
        with_(ENC, max_batch_size=8, dynamic_batching={"preferred_batch_size": [4, 16]}),
        "dynamic_batching.preferred_batch_size: [16] exceed max_batch_size (8)",
    ),
    (
        with_(ENC, dynamic_batching={"max_queue_delay_microseconds": -1}),
        "dynamic_batching.max_queue_delay_microseconds:",
    ),
    (with_(ENC, dynamic_batching={"priority_levels": 0}), "dynamic_batching.priority_levels:"),
    (
        with_(ENC, dynamic_batching={"priority_levels": 2, "default_priority_level": 3}),
        "dynamic_batching.default_priority_level: must be in 0..priority_levels (2)",
    ),
    (
        with_(ENC, dynamic_batching={"default_queue_policy": {"max_queue_size": -1}}),
        "dynamic_batching.default_queue_policy.max_queue_size:",
    ),
    (
        with_(ENC, dynamic_batching={"default_queue_policy": {"default_timeout_microseconds": -5}}),
        "dynamic_batching.default_queue_policy.default_timeout_microseconds:",
    ),
    (
        with_(ENC, dynamic_batching={"default_queue_policy": {"allow_timeout_override": "yes"}}),
        "dynamic_batching.default_queue_policy.allow_timeout_override:",
    ),
    (
        with_(
            ENC,
            dynamic_batching={"max_queue_size": 1, "default_queue_policy": {"max_queue_size": 2}},
        ),
        "dynamic_batching: max_queue_size given both directly and under default_queue_policy",
    ),
    (with_(LLM, dynamic_batching={}), "dynamic_batching: only for encoder backends"),
    (with_(LLM, max_batch_size=8), "max_batch_size: only for encoder backends"),
    (with_(LLM, max_sequence_length=8), "max_sequence_length: only for encoder backends"),
    (with_(ENC, hardware={"device": "tpu"}), "hardware.device:"),
    (with_(ENC, hardware={"device": "cuda", "gpu_id": -1}), "hardware.gpu_id:"),
    (with_(ENC, hardware={"device": "cpu", "gpu_id": 0}), "hardware.gpu_id: needs device: cuda"),
    (with_(ENC, hardware={"gpu_id": 0}), "hardware.gpu_id: needs device: cuda"),
    (with_(ENC, hardware={"workspace_size": "12 parsecs"}), "hardware.workspace_size:"),
    (with_(ENC, hardware={"workspace_size": 0}), "hardware.workspace_size:"),
    (with_(ENC, hardware={"workspace_size": "0MiB"}), "hardware.workspace_size:"),
    (with_(ENC, version_policy={"latest": {"num_versions": 0}}), "version_policy.latest."),
    (with_(ENC, version_policy={"specific": {"versions": []}}), "version_policy.specific."),
    (with_(ENC, version_policy={"specific": {}}), "version_policy.specific.versions:"),
    (
        with_(ENC, version_policy={"specific": {"versions": ["01"]}}),
        "version_policy.specific.versions: version '01' is not allowed",
    ),
    (
        with_(ENC, version_policy={"specific": {"versions": [1, "1"]}}),
        "version_policy.specific.versions:",
    ),
    (
        with_(ENC, version_policy={"latest": {}, "all": {}}),
        "version_policy: give exactly one of latest, all, specific",
    ),
    (with_(ENC, version_policy="newest"), "version_policy:"),
    (with_(ENC, traffic={"1": -1}), "traffic: weight of version 1 must be >= 0"),
    (with_(ENC, traffic={"1": float("inf")}), "traffic: weight of version 1"),
    (with_(ENC, traffic={"1": 0, "2": 0}), "traffic: at least one weight"),
    (with_(ENC, traffic={"v1": 1}), "traffic: version 'v1' is not allowed"),
    (with_(ENC, traffic={"../1": 1}), "traffic: version '../1' is not allowed"),
    (with_(ENC, traffic={1: 1, "1": 2}), "traffic: a version is given twice"),
    (with_(ENC, traffic={"1": "90"}), "traffic.1:"),
    (with_(ENC, traffic={"1": True}), "traffic.1:"),
    (
        with_(ENC, version_policy={"specific": {"versions": [1]}}, traffic={"2": 1}),
        "traffic: version(s) 2 are not in version_policy.specific.versions",
    ),
    (with_(ENC, llm={}), "llm: only for backend llm, not embedding"),
    (with_(LLM, llm={"max_num_seqs": 0}), "llm.max_num_seqs:"),
    (with_(LLM, llm={"max_model_len": 0}), "llm.max_model_len:"),
    (with_(LLM, llm={"max_num_batched_tokens": -3}), "llm.max_num_batched_tokens:"),
    (with_(LLM, llm={"block_size": 12}), "llm.block_size:"),
    (with_(LLM, llm={"quantization": "int3"}), "llm.quantization:"),
    (with_(LLM, llm={"load_format": "pt"}), "llm.load_format:"),
    (with_(LLM, llm={"scheduling_policy": "lifo"}), "llm.scheduling_policy:"),
    (with_(LLM, llm={"kv_cache_memory": 0}), "llm.kv_cache_memory:"),
    (with_(LLM, llm={"num_kv_blocks": 0}), "llm.num_kv_blocks:"),
    (with_(LLM, llm={"num_threads": 2}), "llm.num_threads:"),  # per process, not per model
    (with_(LLM, llm={"enable_prefix_caching": "no"}), "llm.enable_prefix_caching:"),
    (with_(LLM, llm={"cuda_graphs": 1}), "llm.cuda_graphs:"),
    (with_(LLM, llm={"seed": "1"}), "llm.seed:"),
    (
        with_(LLM, llm={"max_model_len": 4096, "enable_chunked_prefill": False}),
        "llm.max_num_batched_tokens: must be >= max_model_len (4096) without chunked prefill",
    ),
    (
        with_(LLM, llm={"kv_cache_memory": 0.5}, hardware={"workspace_size": "1GiB"}),
        "llm.kv_cache_memory: give either it or hardware.workspace_size, not both",
    ),
]


@pytest.mark.parametrize(("data", "expected"), BAD_VALUES)
def test_bad_values_name_file_and_key(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_model_config(data, FILE)
    message = str(error.value)
    assert message.startswith(f"{FILE}: ")
    assert expected in message


def test_the_offending_value_is_shown() -> None:
    with pytest.raises(ConfigError, match=r"max_batch_size: .*\(got '64'\)"):
        parse_model_config(with_(ENC, max_batch_size="64"), FILE)


def test_several_errors_are_all_reported() -> None:
    data = with_(ENC, max_batch_size=0, hardware={"device": "tpu"}, colour=1)
    with pytest.raises(ConfigError) as error:
        parse_model_config(data, FILE)
    for key in ("max_batch_size:", "hardware.device:", "colour: unknown key"):
        assert key in str(error.value)


# --- files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", [("config.yaml", "config.json"), ("config.yml", "config.yaml")])
def test_two_config_files_are_an_error(tmp_path: Path, pair: tuple[str, str]) -> None:
    for name in pair:
        write(tmp_path / "embed" / name, "backend: embedding\n")
    with pytest.raises(ConfigError) as error:
        find_config_file(tmp_path / "embed", "models/embed")
    message = str(error.value)
    assert message.startswith("models/embed: ") and "keep exactly one" in message
    assert all(name in message for name in pair)


def test_find_config_file(tmp_path: Path) -> None:
    assert find_config_file(tmp_path) is None
    path = write(tmp_path / "config.json", '{"backend": "onnx"}')
    assert find_config_file(tmp_path) == path


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("config.yaml", "backend: onnx\nbackend: llm\n", "not valid YAML: .*given twice"),
        ("config.json", '{"backend": "onnx", "backend": "llm"}', "not valid JSON: .*twice"),
        ("config.yaml", "backend: [onnx\n", "not valid YAML"),
        ("config.json", "{backend: onnx}", "not valid JSON"),
        ("config.yaml", "", "must hold a mapping"),
        ("config.yaml", "- backend: onnx\n", "must hold a mapping"),
        ("config.json", '"onnx"', "must hold a mapping"),
        ("config.yaml", "backend: onnx\nhardware:\n  device: gpu\n", "hardware.device:"),
    ],
)
def test_file_errors_name_the_file(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = write(tmp_path / "models" / "embed" / name, text)
    with pytest.raises(ConfigError, match=f"^models/embed/{name}: {expected}"):
        read_model_config(path, f"models/embed/{name}")


def test_an_unreadable_or_huge_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        read_model_config(tmp_path / "config.yaml", "m/config.yaml")
    huge = write(tmp_path / "config.yaml", "backend: onnx\n" + "#" * (1 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        read_model_config(huge, "m/config.yaml")


# --- one-model case ---------------------------------------------------------------------------


def test_single_model_config_matches_the_file_form() -> None:
    single = single_model_config(
        "llm", dtype="bfloat16", device="cuda:1", llm={"max_num_seqs": 4, "block_size": 32}
    )
    written = parse_model_config(
        {
            "backend": "llm",
            "precision_mode": "BF16",
            "hardware": {"device": "cuda", "gpu_id": 1},
            "llm": {"max_num_seqs": 4, "block_size": 32},
        },
        "x",
    )
    assert single == written
    assert single.engine_kwargs()["device"] == "cuda:1"
    assert single.version_policy.select(["1"]) == ["1"]


def test_single_model_config_defaults_follow_qiao_serve() -> None:
    config = single_model_config()
    assert isinstance(config, ModelConfigFile)
    assert config.backend == "llm" and config.dtype_name == "auto"
    assert config.engine_kwargs()["device"] == "auto"
    encoder = single_model_config("embedding", dtype="float16", device="cpu", max_batch_size=16)
    assert encoder.dtype_name == "float16" and encoder.batcher_values()["max_batch_size"] == 16


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"device": "cuda:x"}, "device 'cuda:x'"),
        ({"device": "tpu"}, "--model: hardware.device:"),
        ({"dtype": "float8"}, "--model: precision_mode:"),
        ({"llm": {"block_size": 3}}, "--model: llm.block_size:"),
    ],
)
def test_single_model_config_errors(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        single_model_config("llm", **kwargs)


def test_batcher_values_build_the_batcher_config(tmp_path: Path) -> None:
    from qiao.engine.batcher import BatcherConfig

    config = read_model_config(write(tmp_path / "config.yaml", FULL_ENCODER_YAML))
    batcher = BatcherConfig(**config.batcher_values())
    assert batcher.preferred_batch_sizes == (4, 8)
    assert batcher.max_queue_delay_us == 10000 and batcher.max_queue_size == 128
    assert batcher.default_priority_level == 2 and batcher.allow_timeout_override is True
    assert BatcherConfig(**parse_model_config(ENC, "x").batcher_values()) == BatcherConfig()


def test_circuit_breaker_keys_override_the_server_flags_one_by_one() -> None:
    from qiao.engine.async_engine import AdmissionLimits
    from qiao.engine.breaker import BreakerConfig
    from qiao.repository.loading import VersionBuilder
    from qiao.repository.scan import ModelEntry

    server = AdmissionLimits(breaker=BreakerConfig(failures=5, window=30, cooldown=10))
    builder = VersionBuilder(server)
    own = parse_model_config(
        {"backend": "embedding", "circuit_breaker": {"failures": 2, "cooldown": 1.5}}, "m"
    )
    entry = ModelEntry("m", Path("."), own)
    assert builder.breaker_config(entry) == BreakerConfig(failures=2, window=30, cooldown=1.5)
    plain = ModelEntry("m", Path("."), parse_model_config({"backend": "embedding"}, "m"))
    assert builder.breaker_config(plain) == server.breaker
    with pytest.raises(ConfigError, match=r"circuit_breaker\.window"):
        parse_model_config({"backend": "llm", "circuit_breaker": {"window": 0}}, "m")
    with pytest.raises(ConfigError, match=r"circuit_breaker\.probes"):
        parse_model_config({"backend": "llm", "circuit_breaker": {"probes": 1}}, "m")
