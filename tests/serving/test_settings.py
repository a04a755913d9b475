"""`qiao serve` settings: CLI > environment > config file > defaults, strict files, `--help`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from qiao.api.settings import ServeSettings, load_settings
from qiao.errors import ConfigError

from .conftest import qiao_command


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No QIAO_* variable from the outer environment may leak into these checks."""
    for name in list(os.environ):
        if name.startswith("QIAO_"):
            monkeypatch.delenv(name)
    yield


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(params=["json", "toml"])
def config_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "json":
        values = {"port": 1111, "max-n": 3, "log_interval": 5, "api-key": ["from-file"]}
        return _write(tmp_path / "serve.json", json.dumps(values))
    return _write(
        tmp_path / "serve.toml",
        'port = 1111\nmax-n = 3\nlog_interval = 5\napi-key = ["from-file"]\n',
    )


def test_precedence_cli_over_env_over_file_over_default(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = ServeSettings.model_fields["port"].default
    assert load_settings([]).port == default

    file_only = load_settings(["--config", str(config_file)])
    assert (file_only.port, file_only.max_n, file_only.log_interval) == (1111, 3, 5.0)
    assert file_only.api_key == ["from-file"]

    monkeypatch.setenv("QIAO_PORT", "2222")
    monkeypatch.setenv("QIAO_API_KEY", "env-a, env-b")
    with_env = load_settings(["--config", str(config_file)])
    assert with_env.port == 2222
    assert with_env.api_key == ["env-a", "env-b"]
    assert with_env.max_n == 3  # still from the file

    with_cli = load_settings(
        ["--config", str(config_file), "--port", "3333", "--api-key", "cli-key"]
    )
    assert with_cli.port == 3333
    assert with_cli.api_key == ["cli-key"]
    assert (with_cli.max_n, with_cli.log_interval) == (3, 5.0)

    # The file may also come from the environment.
    monkeypatch.setenv("QIAO_CONFIG", str(config_file))
    assert load_settings([]).max_n == 3


def test_cli_flags_cover_the_serving_knobs() -> None:
    settings = load_settings(
        [
            "--model",
            "/models/x",
            "--host",
            "0.0.0.0",
            "--allow-insecure-public-bind",
            "--max-waiting-requests",
            "8",
            "--stall-timeout",
            "0.5",
            "--drain-timeout",
            "1",
            "--num-kv-blocks",
            "64",
            "--cors-origins",
            "https://a.example",
            "--cors-origins",
            "https://b.example",
        ]
    )
    assert settings.model == "/models/x"
    assert settings.allow_insecure_public_bind is True
    assert (settings.max_waiting_requests, settings.stall_timeout) == (8, 0.5)
    assert (settings.drain_timeout, settings.num_kv_blocks) == (1.0, 64)
    assert settings.cors_origins == ["https://a.example", "https://b.example"]


def test_unknown_key_in_the_file_is_an_error_naming_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "serve.json", json.dumps({"port": 1, "max_tokenz": 5}))
    with pytest.raises(ConfigError, match="max_tokenz"):
        load_settings(["--config", str(path)])
    toml = _write(tmp_path / "serve.toml", "prot = 8000\n")
    with pytest.raises(ConfigError, match="prot"):
        load_settings(["--config", str(toml)])


def test_bad_values_are_errors_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="port"):
        load_settings(["--port", "70000"])
    path = _write(tmp_path / "serve.json", json.dumps({"stall_timeout": -1}))
    with pytest.raises(ConfigError, match="stall"):
        load_settings(["--config", str(path)])
    with pytest.raises(ConfigError, match="not valid"):
        load_settings(["--config", str(_write(tmp_path / "broken.json", "{port: 1"))])
    with pytest.raises(ConfigError, match=r"\.json, \.toml or \.yaml"):
        load_settings(["--config", str(_write(tmp_path / "serve.ini", "port=1"))])


def test_a_loaded_file_does_not_leak_into_later_settings(tmp_path: Path) -> None:
    path = _write(tmp_path / "serve.json", json.dumps({"port": 1111}))
    assert load_settings(["--config", str(path)]).port == 1111
    # Settings built directly (as tests and embedders do) read no file.
    assert ServeSettings().port == ServeSettings.model_fields["port"].default
    assert load_settings([]).port == ServeSettings.model_fields["port"].default


def test_serve_help_lists_the_flags() -> None:
    result = subprocess.run(
        [*qiao_command(), "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for flag in (
        "--model",
        "--host",
        "--port",
        "--api-key",
        "--allow-insecure-public-bind",
        "--max-waiting-requests",
        "--stall-timeout",
        "--drain-timeout",
        "--num-kv-blocks",
        "--log-interval",
        "--config",
    ):
        assert flag in result.stdout, f"{flag} missing from qiao serve --help"
    assert "Traceback" not in result.stdout + result.stderr


def test_quantization_reaches_the_engine_config_and_bad_values_are_named() -> None:
    from qiao.api.server import engine_config

    config, _ = engine_config(load_settings(["--quantization", "int8", "--no-profile"]))
    assert config.model.quantization == "int8"
    config, _ = engine_config(load_settings(["--no-profile"]))
    assert config.model.quantization is None
    for name in ("int4", "w8a8"):
        config, _ = engine_config(load_settings(["--quantization", name, "--no-profile"]))
        assert config.model.quantization == name
    with pytest.raises(ConfigError, match="quantization"):
        load_settings(["--quantization", "int3"])


def test_kv_cache_dtype_reaches_the_engine_config_and_bad_values_are_named() -> None:
    from qiao.api.server import engine_config

    config, _ = engine_config(load_settings(["--kv-cache-dtype", "bfloat16", "--no-profile"]))
    assert config.cache.kv_cache_dtype == "bfloat16"
    config, _ = engine_config(load_settings(["--no-profile"]))
    assert config.cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        load_settings(["--kv-cache-dtype", "int8"])
