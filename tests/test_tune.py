"""`qiao tune` and tuning profiles: the quick tune writes a well-formed profile of measured
choices; `LLM(...)` and `qiao serve` take their defaults from it, explicit settings win; a profile
from another machine or qiao is ignored with a warning; a malformed one is a ConfigError naming
the file. Every test points QIAO_PROFILE_DIR at its own directory."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from qiao import LLM, envs
from qiao.api.server import engine_config
from qiao.api.settings import load_settings
from qiao.bench.cli import _memory
from qiao.bench.tune import default_thread_counts
from qiao.bench.tune_sweeps import budget_for_itl, smallest_near_best
from qiao.cli import main
from qiao.errors import ConfigError
from qiao.profile import (
    MachineFacts,
    ModelIdentity,
    Profile,
    load_profile,
    profile_defaults,
    profile_path,
)

TUNED = {"num_threads": 1, "max_num_seqs": 5, "max_num_batched_tokens": 48, "num_kv_blocks": 40}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def tuned(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Profile, Path]:
    """`qiao tune --quick` on the tiny checkpoint, into the default place of its own dir."""
    profile_dir = tmp_path_factory.mktemp("tuned")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QIAO_PROFILE_DIR", str(profile_dir))
        assert main(["tune", "--model", str(checkpoint), "--quick", "--no-progress"]) == 0
        identity = ModelIdentity.for_checkpoint(checkpoint, "float32", None)
        path = profile_path(identity, MachineFacts.current())
    assert torch.get_num_threads() == threads, "tune must restore the thread count"
    assert path.parent == profile_dir and path.is_file()
    return load_profile(path), path


@pytest.fixture
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty QIAO_PROFILE_DIR for this test; torch's thread count restored afterwards."""
    monkeypatch.setenv("QIAO_PROFILE_DIR", str(tmp_path / "profiles"))
    threads = torch.get_num_threads()
    yield tmp_path / "profiles"
    torch.set_num_threads(threads)


def _install(tuned: tuple[Profile, Path], checkpoint: Path, **changes: object) -> Path:
    """The tuned profile with TUNED settings (and top-level `changes`), where lookups for
    `checkpoint` find it."""
    data = {**json.loads(tuned[0].to_json()), "settings": TUNED, **changes}
    machine = MachineFacts.current()
    path = profile_path(ModelIdentity.for_checkpoint(checkpoint, "float32", None), machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _engine_values(llm: LLM) -> dict[str, int]:
    config = llm.engine.config
    return {
        "num_threads": torch.get_num_threads(),
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "num_kv_blocks": llm.engine.num_kv_blocks,
    }


# --- qiao tune --------------------------------------------------------------------------------


def test_quick_tune_writes_a_well_formed_profile(
    tuned: tuple[Profile, Path], checkpoint: Path
) -> None:
    profile, path = tuned
    assert profile.model == ModelIdentity(
        model=str(checkpoint.resolve()), dtype="float32", quantization=None
    )
    assert profile.machine == MachineFacts.current() and profile.quick
    m, s = profile.measurements, profile.settings
    threads = [c["num_threads"] for c in m["num_threads"]["candidates"]]
    batches = [c["batch_size"] for c in m["max_num_seqs"]["candidates"]]
    budgets = [c["max_num_batched_tokens"] for c in m["max_num_batched_tokens"]["candidates"]]
    assert s.num_threads in threads and threads == list(default_thread_counts(profile.machine))
    assert s.max_num_seqs <= m["max_num_seqs"]["fastest_smallest"] and s.max_num_seqs >= 1
    assert m["max_num_seqs"]["fastest_smallest"] in batches
    assert s.max_num_batched_tokens in budgets and s.max_num_batched_tokens >= s.max_num_seqs
    for sweep, metric in [
        ("num_threads", "decode_tok_s"),
        ("max_num_seqs", "decode_tok_s"),
        ("max_num_batched_tokens", "prefill_tok_s"),
    ]:
        assert all(c[metric] > 0 for c in m[sweep]["candidates"]), sweep
    kv = m["num_kv_blocks"]
    assert s.num_kv_blocks == kv["chosen"] >= s.max_num_seqs * kv["useful_len"] // 16
    assert kv["kv_bytes"] == s.num_kv_blocks * kv["kv_bytes_per_block"]
    assert m["cpu_ceilings"]["copy_gbps"] > 0
    assert json.loads(path.read_text())["settings"] == s.model_dump()


def test_tune_out_and_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    argv = ["tune", "--shape", "tiny", "--quick", "--no-progress", "--out", str(out)]
    argv += ["--threads", "1", "--batch-sizes", "1,2", "--token-budgets", "8,16"]
    assert main(argv + ["--max-memory", "64KiB"]) == 0
    profile = load_profile(out)
    assert profile.model.shape == "tiny" and profile.model.model is None
    assert profile.settings.num_threads == 1
    assert profile.settings.max_num_batched_tokens in (8, 16)
    # 64 KiB of KV at 8 KiB per block: 8 blocks, room for no full 1024-token sequence.
    assert profile.settings.num_kv_blocks == 8 and profile.settings.max_num_seqs == 1
    assert profile.measurements["num_kv_blocks"]["budget"] == "--max-memory"
    assert f"profile written to {out}" in capsys.readouterr().out


def test_tune_for_an_itl_slo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "itl.json"
    argv = ["tune", "--shape", "tiny", "--quick", "--no-progress", "--out", str(out)]
    assert main([*argv, "--threads", "1", "--itl-slo", "0.5"]) == 0
    profile = load_profile(out)
    budgets = profile.measurements["max_num_batched_tokens"]
    assert budgets["itl_slo_s"] == 0.5
    seqs = profile.measurements["max_num_seqs"]
    assert budgets == budget_for_itl(seqs, 0.5, seqs["fastest_smallest"])
    assert profile.settings.max_num_batched_tokens == budgets["chosen"]
    assert profile.settings.max_num_seqs <= budgets["chosen"]
    assert "max_num_batched_tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--itl-slo", "0"])


def test_itl_budget_rule() -> None:
    # Step time 38 ms + 2 ms per token (the 135M shape on 2 cores): under a 250 ms p99 ITL a full
    # step may take 200 ms, so 80 tokens (198 ms), not 96 (230 ms).
    sweep = {"candidates": [{"batch_size": b, "step_ms": 38 + 2 * b} for b in (1, 8, 32, 64)]}
    chosen = budget_for_itl(sweep, 0.25, max_num_seqs=128)
    assert (chosen["chosen"], chosen["max_num_seqs"], chosen["feasible"]) == (80, 80, True)
    assert {"max_num_batched_tokens": 80, "step_ms": 198.0} in chosen["candidates"]
    # Past the largest measured batch the line extends: 1 s allows (800 - 38) / 2 -> 368.
    assert budget_for_itl(sweep, 1.0, max_num_seqs=64)["chosen"] == 368
    assert budget_for_itl(sweep, 1.0, max_num_seqs=64)["max_num_seqs"] == 64
    # An SLO no step meets: the smallest budget, flagged.
    tight = budget_for_itl(sweep, 0.05, max_num_seqs=8)
    assert (tight["chosen"], tight["feasible"]) == (16, False)


def test_choice_rules_and_flag_types() -> None:
    results = [{"b": 1, "t": 10.0}, {"b": 8, "t": 96.0}, {"b": 16, "t": 100.0}, {"b": 32, "t": 99}]
    assert smallest_near_best(results, "b", "t") == 8
    machine = MachineFacts.current().model_copy(update={"num_physical_cores": 12})
    assert default_thread_counts(machine) == (1, 2, 4, 8, 12)
    assert _memory("4GiB") == 4 * 2**30 and _memory("512MB") == 512e6 and _memory("0.2") == 0.2
    with pytest.raises(argparse.ArgumentTypeError):
        _memory("lots")


# --- pickup by LLM ----------------------------------------------------------------------------


def test_llm_takes_defaults_from_the_profile(
    tuned: tuple[Profile, Path],
    checkpoint: Path,
    profile_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = _install(tuned, checkpoint)
    with caplog.at_level(logging.INFO, logger="qiao.profile"):
        llm = LLM(str(checkpoint))
    assert _engine_values(llm) == TUNED
    (line,) = [r.getMessage() for r in caplog.records if r.name == "qiao.profile"]
    assert line.startswith(f"tuning profile {path} applied: num_threads=1, max_num_seqs=5")


def test_explicit_arguments_win_over_the_profile(
    tuned: tuple[Profile, Path], checkpoint: Path, profile_dir: Path
) -> None:
    _install(tuned, checkpoint)
    llm = LLM(str(checkpoint), max_num_seqs=3, num_threads=2)
    assert _engine_values(llm) == {**TUNED, "max_num_seqs": 3, "num_threads": 2}
    # A KV size given as memory replaces the profile's block count; block_size rescales it.
    llm = LLM(str(checkpoint), kv_cache_memory=8192 * 16, block_size=32)
    assert llm.engine.num_kv_blocks == 8
    assert LLM(str(checkpoint), block_size=32).engine.num_kv_blocks == 20
    default = LLM(str(checkpoint), profile=None).engine.config.scheduler
    assert (default.max_num_seqs, default.max_num_batched_tokens) == (128, 2048)


def test_profile_defaults_respect_what_is_given(tuned: tuple[Profile, Path]) -> None:
    profile = tuned[0].model_copy(update={"settings": tuned[0].settings.model_copy(update=TUNED)})
    assert profile_defaults(profile, {"max_num_seqs": None}, 16) == TUNED
    assert profile_defaults(profile, {"num_threads": 4, "kv_cache_memory": 1e6}, 8) == {
        "max_num_seqs": 5,
        "max_num_batched_tokens": 48,
    }
    no_chunking = profile_defaults(profile, {"enable_chunked_prefill": False}, 16)
    assert "max_num_batched_tokens" not in no_chunking and no_chunking["num_kv_blocks"] == 40


def test_explicit_profile_file_for_another_model_applies(
    tuned: tuple[Profile, Path],
    checkpoint: Path,
    profile_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    shape = {"model": None, "shape": "tiny", "dtype": "float32", "quantization": None}
    source = _install(tuned, checkpoint, model=shape)
    given = tmp_path / "given.json"
    source.rename(given)  # not in the default place: only an explicit profile finds it
    assert LLM(str(checkpoint)).engine.config.scheduler.max_num_seqs == 128
    with caplog.at_level(logging.INFO, logger="qiao.profile"):
        assert _engine_values(LLM(str(checkpoint), profile=str(given))) == TUNED
    assert "was measured for shape tiny (float32)" in caplog.text


# --- profiles that do not apply ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"machine": {"cpu_model": "Elsewhere 9000"}}, "measured on another machine"),
        ({"machine": {"num_cpus": 512}}, "measured on another machine"),
        ({"qiao_version": "0.0.1"}, "made by qiao 0.0.1"),
        ({"schema_version": 99}, "schema version 99"),
    ],
)
def test_foreign_profile_is_ignored_with_a_warning(
    tuned: tuple[Profile, Path],
    checkpoint: Path,
    profile_dir: Path,
    caplog: pytest.LogCaptureFixture,
    changes: dict,
    reason: str,
) -> None:
    path = _install(tuned, checkpoint)
    data = json.loads(path.read_text())
    for key, value in changes.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(data))
    for profile in ("auto", str(path)):
        caplog.clear()
        llm = LLM(str(checkpoint), profile=profile)
        assert llm.engine.config.scheduler.max_num_seqs == 128
        (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert str(path) in warning.getMessage() and reason in warning.getMessage()


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "expected a JSON object"),
        ("{}", "schema_version: Field required"),
        ("drop:max_num_seqs", "settings.max_num_seqs"),
        ("set:max_num_seqs=0", "settings.max_num_seqs"),
        ('set:max_num_seqs="8"', "settings.max_num_seqs"),
    ],
)
def test_malformed_profile_is_a_config_error_naming_the_file(
    tuned: tuple[Profile, Path], checkpoint: Path, profile_dir: Path, text: str, names: str
) -> None:
    path = _install(tuned, checkpoint)
    if text.startswith(("drop:", "set:")):
        data = json.loads(path.read_text())
        op, _, item = text.partition(":")
        key, _, value = item.partition("=")
        if op == "drop":
            del data["settings"][key]
        else:
            data["settings"][key] = json.loads(value)
        text = json.dumps(data)
    path.write_text(text)
    with pytest.raises(ConfigError, match=str(path)) as err:
        LLM(str(checkpoint))
    assert names in str(err.value)


def test_cli_reports_a_bad_profile_without_traceback(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    argv = ["generate", "--model", str(checkpoint), "--prompt", "hi", "--profile", str(bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"qiao: error: profile {bad} is not") and "Traceback" not in err
    assert main(["generate", "--model", str(checkpoint), "--profile", str(tmp_path / "no")]) == 2
    assert "cannot be read" in capsys.readouterr().err


# --- pickup by qiao serve ---------------------------------------------------------------------


def test_serve_settings_take_defaults_from_the_profile(
    tuned: tuple[Profile, Path],
    checkpoint: Path,
    profile_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    path = _install(tuned, checkpoint)
    model = ["--model", str(checkpoint)]

    def values(argv: list[str]) -> dict[str, int | None]:
        config, threads = engine_config(load_settings(model + argv))
        return {
            "num_threads": threads,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "num_kv_blocks": config.cache.num_kv_blocks,
        }

    assert values([]) == TUNED
    assert values(["--profile", str(path)]) == TUNED
    assert values(["--max-num-seqs", "7", "--num-threads", "2"]) == {
        **TUNED,
        "max_num_seqs": 7,
        "num_threads": 2,
    }
    monkeypatch.setenv("QIAO_MAX_NUM_BATCHED_TOKENS", "4096")
    config_file = tmp_path / "serve.json"
    config_file.write_text(json.dumps({"num-kv-blocks": 99}))
    assert values(["--config", str(config_file)]) == {
        **TUNED,
        "max_num_batched_tokens": 4096,
        "num_kv_blocks": 99,
    }
    monkeypatch.delenv("QIAO_MAX_NUM_BATCHED_TOKENS")
    assert values(["--no-profile"]) == {
        "num_threads": None,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 2048,
        "num_kv_blocks": None,
    }
    with pytest.raises(ConfigError, match="profile"):
        load_settings(model + ["--profile", str(path), "--no-profile"])


def test_serve_logs_the_profile_it_applied(
    tuned: tuple[Profile, Path], checkpoint: Path, profile_dir: Path, tmp_path: Path
) -> None:
    path = _install(tuned, checkpoint)
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "qiao.cli", "serve", "--model", str(checkpoint), "--port", "0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "Uvicorn running" not in log.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(20)
    text = log.read_text()
    assert f"tuning profile {path} applied: num_threads=1, max_num_seqs=5" in text
    assert "KV cache: 40 blocks" in text


def test_suite_never_reads_the_users_profiles() -> None:
    assert envs.profile_dir() != envs.cache_dir() / "profiles"
