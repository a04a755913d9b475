"""One settings schema: every entry point's engine flags come from qiao/settings_schema.py.

The walk below enumerates the flags of every `qiao` command (subparsers included) and of
`qiao serve`'s pydantic-settings schema, and finds each engine setting defined once: by the
schema, never by a hand-written `add_argument` or `Field`.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from qiao.api.settings import ServeSettings, load_settings
from qiao.cli import build_parser
from qiao.errors import ConfigError
from qiao.settings_schema import BY_NAME, SCHEMA_ATTRIBUTE, resolve_engine_flags

PACKAGE = Path(__file__).resolve().parents[1] / "qiao"


def _flags_of(setting_name: str) -> set[str]:
    setting = BY_NAME[setting_name]
    if setting.kind in ("switch", "tristate"):
        return {setting.flag, "--no-" + setting.flag[2:]}
    return {setting.flag}


SCHEMA_FLAGS = {flag: name for name in BY_NAME for flag in _flags_of(name)}


def _commands(parser: argparse.ArgumentParser, path: str = "qiao"):
    """(command path, parser) for the parser and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}")


def _engine_commands() -> dict[str, argparse.ArgumentParser]:
    """The commands that build an engine: those the schema gave flags to."""
    return {
        path: parser
        for path, parser in _commands(build_parser())
        if any(hasattr(a, SCHEMA_ATTRIBUTE) for a in parser._actions)
    }


def test_every_engine_command_is_found():
    assert set(_engine_commands()) == {
        "qiao generate",
        "qiao bench throughput",
        "qiao bench latency",
        "qiao bench quality",
        "qiao tune",
        "qiao batch run",
    }


def test_every_engine_flag_of_every_command_comes_from_the_schema():
    hand_written = []
    for path, parser in _engine_commands().items():
        for action in parser._actions:
            for option in action.option_strings:
                if option in SCHEMA_FLAGS and getattr(action, SCHEMA_ATTRIBUTE, None) is None:
                    hand_written.append(f"{path}: {option}")
    assert not hand_written, hand_written


def test_the_same_setting_reads_the_same_everywhere():
    """A flag of one setting has one type, choices and meaning in every command (its help may
    only add a note on what its default means there)."""
    seen: dict[str, tuple[str, object, str]] = {}
    for path, parser in _engine_commands().items():
        for action in parser._actions:
            name = getattr(action, SCHEMA_ATTRIBUTE, None)
            if name is None or name == "config":
                continue
            form = (type(action).__name__, tuple(action.choices or ()), name)
            first = seen.setdefault(action.option_strings[0], (path, *form[:2]))
            assert (first[1], first[2]) == form[:2], (path, action.option_strings)
            assert action.help.startswith(BY_NAME[name].help.replace("%", "%%")), (path, name)


def test_serve_declares_the_schema_settings_and_no_second_copy():
    fields = ServeSettings.model_fields
    for name, setting in BY_NAME.items():
        assert name in fields, name
        assert fields[name].description.startswith(setting.help), name
    # No field of the serve schema is hand-declared under an engine setting's name.
    tree = ast.parse((PACKAGE / "api" / "settings.py").read_text())
    declared = {
        node.target.id
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    twice = sorted(declared & (set(BY_NAME) | {"no_" + n for n in BY_NAME}))
    assert not twice, f"declared again in qiao/api/settings.py: {twice}"


# Functions that may spell `--model` / `--seed` themselves, because there the words mean
# something else: the client benchmarks send requests to a running server (`--model` is the model
# id they send, `--seed` their workload's), and `qiao export onnx` takes an encoder checkpoint.
NOT_ENGINE_FLAGS = {
    ("bench/cli.py", "_add_serve"): {"--model", "--seed"},
    ("bench/cli.py", "_add_embeddings"): {"--model", "--seed"},
    ("bench/cli.py", "_add_soak"): {"--model", "--seed"},
    ("cli.py", "_add_export_command"): {"--model"},
    # The server's checkpoint and the workload's seed, not an engine built in this process.
    ("bench/response_cache.py", "main"): {"--model", "--seed"},
    # Flags of the two servers it starts, not of an engine in this process.
    ("bench/adaptive.py", "main"): {"--model", "--profile", "--target-itl-ms"},
}


def test_no_engine_flag_is_spelled_out_anywhere_else():
    """A literal `add_argument("--dtype", ...)` anywhere but the schema is a second copy."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = str(path.relative_to(PACKAGE))
        if relative == "settings_schema.py":
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            allowed = NOT_ENGINE_FLAGS.get((relative, function.name), set())
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and getattr(node.func, "attr", None) == "add_argument"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value in SCHEMA_FLAGS
                    and node.args[0].value not in allowed
                ):
                    found.append(f"qiao/{relative}:{node.lineno} {node.args[0].value}")
    assert not found, found


def _parse(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    resolve_engine_flags(args, environ)
    return args


def test_flag_beats_environment_beats_config_file_beats_default(tmp_path):
    config = tmp_path / "qiao.json"
    config.write_text(json.dumps({"max-num-seqs": 7, "dtype": "float16", "port": 9000}))
    base = ["generate", "--model", "m", "--config", str(config)]
    args = _parse(base, {})
    # The config file's engine keys apply; its server keys (port) are serve's, not an error.
    assert (args.max_num_seqs, args.dtype, args.kv_cache_dtype) == (7, "float16", "auto")
    args = _parse(base, {"QIAO_MAX_NUM_SEQS": "9"})
    assert args.max_num_seqs == 9
    args = _parse([*base, "--max-num-seqs", "11"], {"QIAO_MAX_NUM_SEQS": "9"})
    assert args.max_num_seqs == 11
    # QIAO_CONFIG names the file when --config does not.
    args = _parse(["generate", "--model", "m"], {"QIAO_CONFIG": str(config)})
    assert args.max_num_seqs == 7


def test_switches_and_three_way_switches():
    args = _parse(["generate", "--model", "m", "--no-enable-prefix-caching"], {})
    assert args.enable_prefix_caching is False
    args = _parse(["generate", "--model", "m"], {"QIAO_ENABLE_PREFIX_CACHING": "false"})
    assert args.enable_prefix_caching is False
    assert _parse(["generate", "--model", "m"], {}).cuda_graphs is None
    assert _parse(["generate", "--model", "m", "--no-cuda-graphs"], {}).cuda_graphs is False
    # `batch run` turns batch invariance on when it is left unset; the flag can turn it off.
    assert _parse(["batch", "run", "in.jsonl", "--output", "o"], {}).batch_invariant is None
    settings = load_settings(["--no-cuda-graphs", "--batch-invariant"])
    assert (settings.cuda_graphs_choice, settings.batch_invariant_choice) == (False, True)


def test_bad_values_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match="QIAO_MAX_NUM_SEQS: expected int"):
        _parse(["generate", "--model", "m"], {"QIAO_MAX_NUM_SEQS": "many"})
    with pytest.raises(ConfigError, match="--kv-cache-memory: must be above 0"):
        _parse(["generate", "--model", "m", "--kv-cache-memory", "0"], {})
    config = tmp_path / "c.yaml"
    config.write_text("dtype: fp8\n")
    with pytest.raises(ConfigError, match=r"c.yaml: dtype: must be one of auto"):
        _parse(["generate", "--model", "m", "--config", str(config)], {})
    with pytest.raises(ConfigError, match="missing --model"):
        _parse(["generate"], {})


def test_the_serve_schema_takes_the_same_environment_and_file_keys(tmp_path, monkeypatch):
    config = tmp_path / "serve.toml"
    config.write_text('kv-cache-dtype = "bfloat16"\nmax_num_batched_tokens = 96\n')
    monkeypatch.setenv("QIAO_MAX_NUM_SEQS", "5")
    settings = load_settings(["--config", str(config)])
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (5, 96)
    assert settings.kv_cache_dtype == "bfloat16"
    monkeypatch.setenv("QIAO_MAX_NUM_SEQS", "0")
    with pytest.raises(ConfigError, match="max-num-seqs"):
        load_settings([])


def test_llm_checks_its_arguments_as_the_cli_does():
    from qiao import LLM

    with pytest.raises(ConfigError, match=r"LLM\(dtype=...\): must be one of auto"):
        LLM("unused", dtype="fp8")
    with pytest.raises(ConfigError, match=r"LLM\(max_num_seqs=...\): must be at least 1"):
        LLM("unused", max_num_seqs=0)
