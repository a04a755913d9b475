"""`qiao export onnx`: a BERT sentence encoder as one ONNX graph, checked, as a version folder.

The graph includes mean pooling and normalisation: inputs `input_ids` and `attention_mask`
(int64 [batch, seq], both axes dynamic), output `embedding` (float32 [batch, dim]). Before the
folder is written, onnxruntime's outputs are compared with the PyTorch encoder's on inputs of
several batch sizes and lengths. The folder (model.onnx, tokenizer files, config.json,
qiao_encoder.json) is built in a hidden sibling directory and renamed into place, so a
repository poller never sees a half-written version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from qiao.errors import ConfigError, QiaoError
from qiao.logs import heartbeat
from qiao.models.bert import (
    BertSentenceEncoder,
    load_pooling_config,
    load_sentence_encoder,
    max_sequence_length,
)
from qiao.runner.encoder import (
    ONNX_INPUTS,
    ONNX_MODEL_FILE,
    ONNX_OUTPUT,
    TOKENIZER_FILE,
    OnnxEncoderMetadata,
)

if TYPE_CHECKING:
    import onnx_ir

logger = logging.getLogger("qiao.export")

# Copied beside the graph when present (tokenizer.json and config.json must be).
_COPIED_FILES = (
    TOKENIZER_FILE,
    "config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
_CHECK_SEED = 0


class ExportError(QiaoError):
    """The exporter failed, or the exported graph disagrees with PyTorch beyond `atol`."""


@dataclass(frozen=True)
class ExportReport:
    out_dir: Path  # the version folder written
    model_file: Path  # out_dir / model.onnx
    opset: int
    max_abs_diff: float  # onnxruntime vs PyTorch over every check input
    atol: float
    checked_shapes: tuple[tuple[int, int], ...]  # (batch, seq) of each check input
    seconds: float


def export_onnx(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    opset: int | None = None,
    atol: float = 1e-4,
    overwrite: bool = False,
) -> ExportReport:
    """Export the encoder of the checkpoint in `model_dir` into the version folder `out_dir`.

    `opset`: the ONNX opset (None: the exporter's default). Raises `ConfigError` for a bad
    argument or a non-empty `out_dir` without `overwrite`, `ModelLoadError` for an unreadable
    checkpoint, `ExportError` when exporting fails or the check finds a difference > `atol`.
    """
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir).resolve(), Path(out_dir).resolve()
    _check_out_dir(model_dir, out_dir, overwrite)
    if not atol >= 0:
        raise ConfigError(f"atol: must be >= 0, got {atol}")
    if opset is not None and opset < 1:
        raise ConfigError(f"opset: must be a positive opset version, got {opset}")
    logger.info("export 1/4: loading the encoder from %s", model_dir)
    model = load_sentence_encoder(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    config = model.bert.config
    max_length = max_sequence_length(config, load_pooling_config(model_dir))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    try:
        model_file = staging / ONNX_MODEL_FILE
        with heartbeat(logger, "export 2/4: tracing and exporting the graph (torch.onnx)"):
            actual_opset = export_graph(model, model_file, opset)
        cases = check_inputs(config.vocab_size, max_length)
        logger.info("export 3/4: checking onnxruntime against PyTorch on %d inputs", len(cases))
        max_abs_diff = verify_onnx(model_file, model, cases, atol)
        logger.info("export 4/4: writing the version folder %s", out_dir)
        for name in _COPIED_FILES:
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, staging / name)
        OnnxEncoderMetadata(
            dim=config.hidden_size,
            max_length=max_length,
            vocab_size=config.vocab_size,
            normalize=model.normalize,
            opset=actual_opset,
            max_abs_diff=max_abs_diff,
            atol=atol,
            source=str(model_dir),
        ).write(staging)
        _move_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportReport(
        out_dir=out_dir,
        model_file=out_dir / ONNX_MODEL_FILE,
        opset=actual_opset,
        max_abs_diff=max_abs_diff,
        atol=atol,
        checked_shapes=tuple(ids.shape for ids, _ in cases),
        seconds=time.perf_counter() - start,
    )


def export_graph(model: BertSentenceEncoder, path: Path, opset: int | None) -> int:
    """Write `model` to `path` as one self-contained ONNX file; returns its opset."""
    max_positions = model.bert.config.max_position_embeddings
    # Sizes of 0 and 1 would be specialised by torch.export: trace with 2 rows of 8 tokens
    # (one padded) and declare both axes dynamic.
    seq = min(8, max_positions)
    input_ids = torch.ones(2, seq, dtype=torch.int64)
    attention_mask = torch.ones(2, seq, dtype=torch.int64)
    attention_mask[1, seq // 2 :] = 0
    batch_dim = torch.export.Dim("batch", min=1)
    seq_dim = torch.export.Dim("seq", min=1, max=max_positions)
    axes = {0: batch_dim, 1: seq_dim}
    try:
        with _quiet_exporter():
            program = torch.onnx.export(
                model,
                (input_ids, attention_mask),
                input_names=list(ONNX_INPUTS),
                output_names=[ONNX_OUTPUT],
                opset_version=opset,
                dynamo=True,
                external_data=False,
                dynamic_shapes={name: axes for name in ONNX_INPUTS},
                verbose=False,
            )
            _rename_clashing_values(program.model.graph, ONNX_OUTPUT)
            program.save(str(path), external_data=False)
    except Exception as e:  # the exporter raises many types; report them as one
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {e}") from e
    actual = _opset_of(path)
    if opset is not None and actual != opset:
        # The exporter writes its own opset and converts down on request, keeping the model
        # unchanged when conversion fails.
        raise ExportError(
            f"opset: the exporter could not convert the graph to opset {opset} (it stays at "
            f"{actual}); choose {actual} or another supported opset"
        )
    return actual


def check_inputs(
    vocab_size: int, max_length: int, seed: int = _CHECK_SEED
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, attention_mask) pairs of batch sizes 1, 3 and 6 up to `max_length` tokens.

    Row 0 of each is full length; the other rows are padded to random lengths."""
    rng = np.random.default_rng(seed)
    shapes = [(1, 1), (3, min(13, max_length)), (6, max_length)]
    cases = []
    for batch, seq in shapes:
        lengths = rng.integers(1, seq + 1, size=batch)
        lengths[0] = seq
        mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
        input_ids = rng.integers(0, vocab_size, size=(batch, seq), dtype=np.int64) * mask
        cases.append((input_ids, mask))
    return cases


def verify_onnx(
    model_file: Path,
    reference: torch.nn.Module,
    cases: Sequence[tuple[np.ndarray, np.ndarray]],
    atol: float,
) -> float:
    """Max abs difference between onnxruntime and `reference` over `cases`; raises
    `ExportError` naming the input shape when one exceeds `atol`."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    max_abs_diff = 0.0
    for input_ids, attention_mask in cases:
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        got = session.run([ONNX_OUTPUT], feeds)[0]
        with torch.inference_mode():
            want = reference(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        want = want.float().numpy()
        if got.shape != want.shape:
            raise ExportError(
                f"ONNX output shape {got.shape} != PyTorch's {want.shape} "
                f"for input shape {input_ids.shape}"
            )
        diff = float(np.abs(got - want).max())
        if not diff <= atol:  # also catches NaN
            raise ExportError(
                f"ONNX output differs from PyTorch for input shape {input_ids.shape}: "
                f"max abs diff {diff:.3g} > atol {atol:g}"
            )
        max_abs_diff = max(max_abs_diff, diff)
    return max_abs_diff


def _check_out_dir(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir == model_dir or model_dir.is_relative_to(out_dir):
        raise ConfigError(f"out_dir: {out_dir} holds the checkpoint being exported; pick another")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out_dir: {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(
            f"out_dir: {out_dir} is not empty; choose a new folder or pass overwrite=True "
            "(--overwrite) to replace it"
        )


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir`; an existing `out_dir` is moved aside first and removed
    after, so `out_dir` is never half-written."""
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / out_dir.name)
    try:
        os.rename(staging, out_dir)
    except OSError:
        os.rename(old / out_dir.name, out_dir)
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)


def _rename_clashing_values(graph: onnx_ir.Graph, output_name: str) -> None:
    """The exporter names the word-embedding lookup's result `embedding` (after its aten op),
    which clashes with the graph output of that name; give inner values a fresh name."""
    output = next(v for v in graph.outputs if v.name == output_name)
    for node in graph:
        for value in node.outputs:
            if value.name == output_name and value is not output:
                value.name = f"{output_name}_inner_{id(value)}"


def _opset_of(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's deprecation warnings, its notes about optional packages
    (torchvision) and the tracebacks it logs for failures it recovers from; errors still
    raise."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
