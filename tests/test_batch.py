"""`qiao batch run` over OpenAI batch files (issue 20): answers equal transformers' greedy
generations and embeddings, bad lines become error lines, and a run SIGKILLed at random points
then resumed writes exactly what an uninterrupted run writes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import qiao
from qiao.cli import main

DEMO_DIR = Path(qiao.__file__).parent / "demo_model"


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(*argv: str | Path) -> int:
    return main(["batch", "run", *map(str, argv), "--no-progress"])


def _hf_greedy(prompts: list[str], max_new_tokens: int) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens
            )
        texts.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return texts


def _hf_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    """transformers AutoModel, mean pooling over the attention mask, L2 normalised (what
    all-MiniLM-L6-v2's sentence-transformers modules do)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch.attention_mask.unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_answers_match_transformers_and_bad_lines_are_error_lines(
    tmp_path: Path, minilm_dir: Path
) -> None:
    prompts = ["Once upon a time", "The king said"]
    lines = [
        _line(
            "cmpl",
            "/v1/completions",
            {"model": "demo", "prompt": prompts, "max_tokens": 8, "temperature": 0},
        ),
        "this line is not JSON",
        _line(
            "chat",
            "/v1/chat/completions",
            {
                "model": "demo",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        ),
        _line("emb", "/v1/embeddings", {"model": "minilm", "input": ["hello world", "a fox"]}),
        _line("cmpl", "/v1/completions", {"model": "demo", "prompt": "reused id"}),
        _line("hot", "/v1/completions", {"model": "demo", "prompt": "x", "temperature": -1}),
        _line("far", "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 10**6}),
        _line("stream", "/v1/completions", {"model": "demo", "prompt": "x", "stream": True}),
        _line("where", "/v1/images", {"model": "demo"}),
        "",
        _line("last", "/v1/completions", {"model": "demo", "prompt": "The end", "max_tokens": 2}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(source, "-o", out, "--dtype", "float32") == 0

    answered = _read(out)
    assert [r["custom_id"] for r in answered] == ["cmpl", "chat", "emb", "last"]  # input order
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in answered)
    assert len({r["id"] for r in answered}) == 4

    completion = answered[0]["response"]["body"]
    assert completion["object"] == "text_completion" and completion["model"] == "demo"
    assert [c["text"] for c in completion["choices"]] == _hf_greedy(prompts, 8)
    assert completion["usage"]["completion_tokens"] == 16

    chat = answered[1]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 6

    embedding = answered[2]["response"]["body"]
    vectors = np.array([row["embedding"] for row in embedding["data"]], dtype=np.float32)
    np.testing.assert_allclose(
        vectors, _hf_embeddings(minilm_dir, ["hello world", "a fox"]), atol=1e-4
    )

    errors = {r["custom_id"]: r for r in _read(tmp_path / "out.errors.jsonl")}
    assert errors[None]["response"] is None
    assert errors[None]["error"]["code"] == "invalid_json"
    assert "line 2" in errors[None]["error"]["message"]

    def message(custom_id: str) -> tuple[int, str]:
        response = errors[custom_id]["response"]
        return response["status_code"], response["body"]["error"]["message"]

    assert set(errors) == {None, "cmpl", "hot", "far", "stream", "where"}
    assert message("cmpl") == (
        400,
        "custom_id 'cmpl' is already used on line 1; each line needs its own",
    )
    assert message("hot")[0] == 400 and message("hot")[1].startswith("temperature:")
    assert message("far")[0] == 400 and "max_tokens" in message("far")[1]
    assert message("stream")[1] == "body.stream: a batch request cannot stream"
    assert message("where")[0] == 400 and "url must be one of" in message("where")[1]
    assert not (tmp_path / "out.jsonl.state.sqlite").exists()  # removed once the files are written


def _batch_file(path: Path, count: int) -> None:
    rng = random.Random(7)
    words = ["the", "fox", "king", "river", "small", "dog", "ran", "sun", "girl", "tree"]
    lines = []
    for i in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        if i % 3 == 0:
            body = {"model": "demo", "messages": [{"role": "user", "content": prompt}]}
            url = "/v1/chat/completions"
        else:
            body = {"model": "demo", "prompt": prompt}
            url = "/v1/completions"
        body.update(max_tokens=rng.randint(4, 24), temperature=0)
        lines.append(_line(f"req-{i}", url, body))
        if i == count // 2:
            lines.append("{broken")
    path.write_text("\n".join(lines) + "\n")


def _without_run_ids(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records without what differs between two runs by design: ids (derived from the job's
    id) and creation times."""
    for record in records:
        record.pop("id")
        response = record.get("response")
        if response:
            response.pop("request_id")
            response["body"].pop("id", None)
            response["body"].pop("created", None)
    return records


def _done(state: Path) -> int:
    if not state.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.OperationalError:  # the table is not created yet
        return 0


@pytest.mark.slow
def test_sigkilled_five_times_then_resumed_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    _batch_file(source, 600)
    flags = ["--no-progress", "--commit-interval", "0.05", "--max-num-seqs", "16"]
    command = [sys.executable, "-m", "qiao.cli", "batch", "run", str(source)]

    reference = tmp_path / "reference.jsonl"
    done = subprocess.run([*command, "-o", str(reference), *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "out.jsonl"
    state = tmp_path / "out.jsonl.state.sqlite"
    rng = random.Random(11)
    progress = [0]
    for _ in range(5):
        process = subprocess.Popen(
            [*command, "-o", str(out), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        # Wait (on the state file) until this run has saved new lines, then kill it at a random
        # moment a little later: mid-step, mid-commit, wherever it is.
        while _done(state) <= progress[-1] and process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.02)
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=rng.uniform(0.0, 0.2))
        process.send_signal(signal.SIGKILL)
        process.wait()
        progress.append(_done(state))
        assert not out.exists()  # nothing under the final name until the run completes
    assert progress == sorted(progress) and progress[-1] < 601, progress

    resumed = subprocess.run([*command, "-o", str(out), *flags], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming: {progress[-1]} of 601 lines were done" in resumed.stderr

    got, want = _read(out), _read(reference)
    assert [r["custom_id"] for r in got] == [f"req-{i}" for i in range(600)]
    assert _without_run_ids(got) == _without_run_ids(want)
    assert _read(tmp_path / "out.errors.jsonl")[0]["error"]["code"] == "invalid_json"


def test_a_resume_with_another_input_is_refused(tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    body = {"model": "demo", "prompt": "Once", "max_tokens": 2}
    source.write_text(_line("a", "/v1/completions", body) + "\n")
    out = tmp_path / "out.jsonl"
    assert _run(source, "-o", out, "--keep-state") == 0
    source.write_text(_line("b", "/v1/completions", body) + "\n")
    assert _run(source, "-o", out) == 2
    error = capsys.readouterr().err
    assert "holds 1 finished lines of a run with other inputs (input_sha256:" in error
    assert "--restart" in error
    assert _run(source, "-o", out, "--restart") == 0
    assert [r["custom_id"] for r in _read(out)] == ["b"]
    # A finished output with no run in progress is not silently redone.
    assert _run(source, "-o", out) == 2
    assert "pass --overwrite to run the batch again" in capsys.readouterr().err


def test_results_go_to_fsspec_urls(tmp_path: Path, capsys) -> None:
    """OUTPUT as a memory:// URL (fsspec's in-process file system: an object store stand-in
    with no network) and as a file:// URL; the default error file sits beside the output."""
    import fsspec

    source = tmp_path / "in.jsonl"
    body = {"model": "demo", "prompt": "Once", "max_tokens": 3, "temperature": 0}
    source.write_text(
        "\n".join(
            [_line("a", "/v1/completions", body), "{broken", _line("b", "/v1/completions", body)]
        )
        + "\n"
    )
    local = tmp_path / "local.jsonl"
    assert _run(source, "-o", local) == 0
    want = _without_run_ids(_read(local))

    memory = fsspec.filesystem("memory")
    url = f"memory://results-{os.getpid()}/run/out.jsonl"
    state = tmp_path / "memory.state.sqlite"
    assert _run(source, "-o", url, "--state", state) == 0
    assert f"2 answered → {url}" in capsys.readouterr().err
    with memory.open(url.removeprefix("memory://"), "r") as file:
        got = [json.loads(line) for line in file.read().splitlines()]
    assert _without_run_ids(got) == want
    with memory.open(f"results-{os.getpid()}/run/out.errors.jsonl", "r") as file:
        assert json.loads(file.readline())["error"]["code"] == "invalid_json"
    assert [p.rsplit("/", 1)[1] for p in memory.ls(f"results-{os.getpid()}/run", detail=False)] == [
        "out.errors.jsonl",
        "out.jsonl",
    ]  # no temporary left behind
    assert not state.exists()  # removed once the files are written
    # A finished URL is not silently redone, as a finished local file is not.
    assert _run(source, "-o", url, "--state", state) == 2
    assert "pass --overwrite" in capsys.readouterr().err

    target = tmp_path / "sub" / "file-url.jsonl"
    assert _run(source, "-o", f"file://{target}") == 0
    assert _without_run_ids(_read(target)) == want
    assert (tmp_path / "sub" / "file-url.errors.jsonl").is_file()
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [
        "file-url.errors.jsonl",
        "file-url.jsonl",
    ]


def test_a_url_output_keeps_its_state_in_the_cache_directory() -> None:
    from qiao import envs
    from qiao.batch.cli import default_paths

    errors, state = default_paths("s3://bucket/jobs/out.jsonl")
    assert errors == "s3://bucket/jobs/out.errors.jsonl"
    assert state.parent == envs.cache_dir() / "batch" and state.name.endswith(".state.sqlite")
    assert default_paths("s3://bucket/jobs/other.jsonl")[1] != state
    assert default_paths(Path("/data/out.jsonl")) == (
        Path("/data/out.errors.jsonl"),
        Path("/data/out.jsonl.state.sqlite"),
    )


def test_a_failed_write_leaves_nothing_under_the_final_name() -> None:
    import fsspec

    from qiao.batch.results import write_lines_atomically

    memory = fsspec.filesystem("memory")
    folder = f"atomic-{os.getpid()}"

    def lines():
        yield "one"
        yield "two"
        raise RuntimeError("the store went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_lines_atomically(f"memory://{folder}/out.jsonl", lines())
    assert not memory.exists(f"{folder}/out.jsonl")
    assert not memory.exists(folder) or memory.ls(folder, detail=False) == []
    assert write_lines_atomically(f"memory://{folder}/out.jsonl", ["a", "b"]) == 2
    with memory.open(f"{folder}/out.jsonl", "r") as file:
        assert file.read() == "a\nb\n"


def test_an_unknown_url_protocol_is_a_clear_error(tmp_path: Path, capsys) -> None:
    source = tmp_path / "in.jsonl"
    body = {"model": "demo", "prompt": "Once", "max_tokens": 2}
    source.write_text(_line("a", "/v1/completions", body) + "\n")
    state = tmp_path / "s.sqlite"
    assert _run(source, "-o", "nosuchproto://bucket/out.jsonl", "--state", state) == 2
    assert "cannot write to nosuchproto://bucket/out.jsonl" in capsys.readouterr().err
