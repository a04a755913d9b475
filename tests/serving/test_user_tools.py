"""The users' own tools, unmodified, against `qiao serve` (issue 19): lm-eval's
`local-completions` loglikelihood on a tiny local task, guidellm with its default backend, and
Triton's perf_analyzer on the embedding model over HTTP and gRPC.

Opt-in (`-m tools`): the tools have their own pins, so they live in their own virtual environment,
built from the `tools` extra of pyproject.toml by `./dev test-tools` (which then runs this file).
`QIAO_TOOLS_BIN` names that environment's bin directory; without the tools there the tests skip
and say so.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from .conftest import SubprocessServer

pytestmark = pytest.mark.tools

TOOLS_BIN = Path(os.environ.get("QIAO_TOOLS_BIN", Path(__file__).parents[2] / ".venv-tools/bin"))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
DOCS = [
    ("Once upon a time, there was a little girl named Lily. She loved to play", " outside"),
    ("Tom had a big red ball. He liked to throw the", " ball"),
    ("The sun was shining and the birds were", " singing"),
    ('Mom said, "It is time to go to', " bed"),
]


def _tool(name: str) -> Path:
    path = TOOLS_BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {TOOLS_BIN}: run ./dev test-tools")
    return path


def _run(argv: list[str], cwd: Path) -> str:
    env = {**os.environ, **OFFLINE}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def server(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`qiao serve` on stories260K in float32, so its log-probabilities compare with
    transformers' at float32 rounding."""
    log_path = tmp_path_factory.mktemp("tools-server") / "server.log"
    args = ["--model", str(stories_dir), "--dtype", "float32", "--log-interval", "0"]
    server = SubprocessServer(args, log_path)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_lm_eval_local_completions_loglikelihood_matches_transformers(
    server: SubprocessServer, stories_dir: Path, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    lm_eval = _tool("lm_eval")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "target": t}) + "\n" for c, t in DOCS))
    (tmp_path / "qiao_tiny.yaml").write_text(
        "task: qiao_tiny\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    model_args = (
        f"model={stories_dir.name},base_url={server.base_url}/v1/completions,"
        f"tokenizer={stories_dir},tokenizer_backend=huggingface,num_concurrent=2,max_retries=1"
    )
    _run(
        [
            str(lm_eval),
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "qiao_tiny",
            "--include_path",
            str(tmp_path),
            "--batch_size",
            "1",
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        cwd=tmp_path,
    )
    samples = [
        json.loads(line) for f in (tmp_path / "out").rglob("samples_*.jsonl") for line in f.open()
    ]
    assert len(samples) == len(DOCS)
    # The reference: transformers on the same weights, the continuation's summed log-softmax,
    # over the ids lm-eval sends (its API models encode without special tokens: no BOS).
    tokenizer = transformers.AutoTokenizer.from_pretrained(stories_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32)
    for sample in samples:
        context, target = sample["doc"]["context"], sample["doc"]["target"]
        whole = tokenizer(context + target, add_special_tokens=False)["input_ids"]
        n_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            logits = hf(torch.tensor([whole])).logits[0].float()
        logprobs = F.log_softmax(logits[:-1], dim=-1)
        positions = range(n_context - 1, len(whole) - 1)
        expected = sum(logprobs[i, whole[i + 1]].item() for i in positions)
        greedy = all(logprobs[i].argmax().item() == whole[i + 1] for i in positions)
        loglikelihood, is_greedy = sample["resps"][0][0]
        assert math.isclose(float(loglikelihood), expected, rel_tol=1e-4, abs_tol=1e-4), sample
        assert str(is_greedy) == str(greedy)  # the samples file writes it as "True" / "False"


def test_guidellm_runs_clean_with_its_default_backend(
    server: SubprocessServer, stories_dir: Path, tmp_path: Path
) -> None:
    guidellm = _tool("guidellm")
    report = tmp_path / "guidellm.json"
    _run(
        [
            str(guidellm),
            "run",
            "--backend",
            f"kind=openai_http,target={server.base_url}",
            "--profile",
            "kind=synchronous",
            "--constraint",
            "kind=max_requests,count=8",
            "--data",
            "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
            "--tokenizer",
            f"kind=huggingface_auto,model={stories_dir}",
            "--disable-console-interactive",
            "--output",
            f"kind=json,path={report}",
        ],
        cwd=tmp_path,
    )
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    assert benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] > 0


def _perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer (from the tritonclient 2.42 wheel) links libcudart, even with no GPU: the
    nvidia-cuda-runtime-cu12 wheel in the same venv carries it. It also needs Debian's
    libb64-0d."""
    _tool("perf_analyzer")
    libs = sorted(TOOLS_BIN.parent.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib"))
    env = dict(os.environ)
    if libs:
        env["LD_LIBRARY_PATH"] = ":".join([str(libs[0]), env.get("LD_LIBRARY_PATH", "")])
    ldd = shutil.which("ldd")
    if ldd:
        linked = subprocess.run(
            [ldd, str(TOOLS_BIN / "perf_analyzer")], env=env, capture_output=True, text=True
        ).stdout
        missing = [line.split()[0] for line in linked.splitlines() if "not found" in line]
        if missing:
            pytest.skip(f"perf_analyzer cannot load {missing}: apt-get install libb64-0d")
    return env


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory):
    """A bare `qiao serve` (the demo LLM and MiniLM) with its gRPC port."""
    log_path = tmp_path_factory.mktemp("tools-embedding-server") / "server.log"
    server = SubprocessServer(["--grpc-port", "0", "--log-interval", "0"], log_path)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_embedding_model(
    embedding_server: SubprocessServer, protocol: str, tmp_path: Path
) -> None:
    env = _perf_analyzer_env()
    if protocol == "http":
        url = f"127.0.0.1:{embedding_server.port}"
    else:
        match = re.search(r"gRPC .*?127\.0\.0\.1:(\d+)", embedding_server.log())
        assert match, embedding_server.log()[-2000:]
        url = f"127.0.0.1:{match.group(1)}"
    report = tmp_path / "perf.csv"
    argv = [
        str(TOOLS_BIN / "perf_analyzer"),
        "-m",
        "all-MiniLM-L6-v2",
        "-u",
        url,
        "-i",
        protocol,
        "--string-data",
        "a sentence to embed",
        "--concurrency-range",
        "1:2",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "20",
        # What is tested is the protocol, not a stable latency: a loaded 2-core machine seldom
        # holds perf_analyzer's default 10% between windows.
        "--stability-percentage",
        "100",
        "--max-trials",
        "20",
        "-f",
        str(report),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "Throughput" in output and "error" not in output.lower(), output[-4000:]
    rows = [line.split(",") for line in report.read_text().splitlines()]
    assert rows[0][0] == "Concurrency" and [r[0] for r in rows[1:]] == ["1", "2"], output
    # The server-side columns come from qiao's statistics extension: the model computed.
    infer = rows[0].index("Server Compute Infer")
    assert all(int(r[infer]) > 0 for r in rows[1:]), rows
