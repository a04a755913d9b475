"""Sentence encoders as the serving layer runs them: text -> token ids -> one vector per text.

Two backends behind one `Encoder` protocol: `TorchEncoder` runs the BERT encoder of a Hugging
Face checkpoint in PyTorch, `OnnxEncoder` runs a version folder written by `qiao export onnx`
in onnxruntime. Both tokenize with the checkpoint's `tokenizer.json` (the `tokenizers` library;
no transformers import at serve time) and return float32 [rows, dim] embeddings, mean-pooled
over the real tokens and L2-normalised when the checkpoint says so (as sentence-transformers).

This module also owns the ONNX version folder's metadata file (`OnnxEncoderMetadata`), which the
exporter writes and `OnnxEncoder` reads.
"""

from __future__ import annotations

import ctypes
import json
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch
from torch import nn

from qiao.errors import ConfigError, ModelLoadError
from qiao.hal.platform import DTYPES
from qiao.layers.linear_method import choose_method
from qiao.models.bert import (
    load_bert_config,
    load_pooling_config,
    load_sentence_encoder,
    max_sequence_length,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True, slots=True)
class Precision:
    """How the PyTorch backend runs at one repository `precision_mode`."""

    dtype: torch.dtype  # weights and activations (attention, GELU, LayerNorm) outside linears
    quantization: str | None = None  # the linear layers' method (`choose_method`), else dtype


# Repository `precision_mode` -> the PyTorch backend's precision. INT8: every BERT linear as
# W8A8 (per-channel int8 weights, per-token int8 activations, exact int32 sums; qiao's
# quant_w8a8), the rest in float32. Pooling and normalisation are float32 in all of them.
PRECISIONS: dict[str, Precision] = {
    "FP32": Precision(torch.float32),
    "FP16": Precision(torch.float16),
    "BF16": Precision(torch.bfloat16),
    "INT8": Precision(torch.float32, "w8a8"),
}
QUANTIZATIONS = ("w8a8",)
BACKENDS = ("embedding", "onnx")
TOKENIZER_FILE = "tokenizer.json"
ONNX_MODEL_FILE = "model.onnx"
ONNX_METADATA_FILE = "qiao_encoder.json"
ONNX_FORMAT = "qiao-onnx-encoder"
ONNX_INPUTS = ("input_ids", "attention_mask")
ONNX_OUTPUT = "embedding"


class Encoder(Protocol):
    """Text -> token ids -> embeddings. `embed` may run on a worker thread (one call at a time)."""

    dim: int  # embedding size
    max_length: int  # longest token sequence accepted, [CLS] and [SEP] included

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with [CLS]/[SEP]; longer texts are cut to `max_length`."""
        ...

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 [len(token_ids), dim]. Raises `ConfigError` for an empty batch, an empty row,
        a row longer than `max_length` or an id outside the vocabulary."""
        ...


@dataclass(frozen=True, slots=True)
class OnnxEncoderMetadata:
    """`qiao_encoder.json` of an exported version folder: what `OnnxEncoder` needs besides the
    graph, and how the export was checked."""

    dim: int
    max_length: int
    vocab_size: int
    normalize: bool  # already applied inside the graph; recorded for the reader
    opset: int
    max_abs_diff: float  # ONNX Runtime vs PyTorch on the export's check inputs
    atol: float
    source: str  # the checkpoint directory exported
    format: str = ONNX_FORMAT
    format_version: int = 1

    def write(self, folder: Path) -> None:
        (folder / ONNX_METADATA_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> OnnxEncoderMetadata:
        path = folder / ONNX_METADATA_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"{path} not found: an onnx version folder is written by `qiao export onnx`"
            )
        try:
            raw = json.loads(path.read_text())
            metadata = cls(**raw)
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ModelLoadError(f"{path}: not a valid qiao encoder metadata file ({e})") from None
        if metadata.format != ONNX_FORMAT or metadata.format_version != 1:
            raise ModelLoadError(
                f"{path}: format {metadata.format!r} v{metadata.format_version} unsupported; "
                f"expected {ONNX_FORMAT!r} v1"
            )
        return metadata


class _TokenizingEncoder:
    """Tokenizing and batch building shared by both backends."""

    dim: int
    vocab_size: int

    def __init__(self, tokenizer_dir: Path, max_length: int, vocab_size: int, dim: int) -> None:
        self.dim = dim
        self.vocab_size = vocab_size
        self.model_max_length = max_length  # the model's own limit; max_length may go lower
        self._tokenizer = load_tokenizer(tokenizer_dir, max_length)
        self._max_length = max_length

    @property
    def max_length(self) -> int:
        return self._max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        """Lower the limit (a repository's `max_sequence_length`); tokenize() truncates to it.

        Set it before serving: the tokenizer is reconfigured in place."""
        if not 1 <= value <= self.model_max_length:
            raise ConfigError(
                f"max_sequence_length: must be in [1, {self.model_max_length}] for this model, "
                f"got {value}"
            )
        self._tokenizer.enable_truncation(value)
        self._max_length = value

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str):
            raise ConfigError("texts: expected a list of strings, got one string")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ConfigError(f"texts[{i}]: expected a string, got {type(text).__name__}")
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def _padded_batch(self, token_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask), int64 [rows, longest row], after checking every row."""
        return pad_rows(self._checked_rows(token_ids))

    def _checked_rows(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The rows as int64 arrays, after checking their lengths and ids."""
        rows = [row.astype(np.int64, copy=False) for row in self._check_rows(token_ids)]
        flat = np.concatenate(rows)
        if flat.min() < 0 or flat.max() >= self.vocab_size:
            bad = int(flat[(flat < 0) | (flat >= self.vocab_size)][0])
            raise ConfigError(
                f"token_ids: id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        return rows

    def _check_rows(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if len(token_ids) == 0:
            raise ConfigError("token_ids: empty batch; give at least one sequence")
        rows = [np.asarray(row) for row in token_ids]
        for i, row in enumerate(rows):
            if row.ndim != 1 or row.size == 0:
                raise ConfigError(f"token_ids[{i}]: expected a non-empty list of token ids")
            if row.dtype.kind not in "iu":
                raise ConfigError(f"token_ids[{i}]: token ids must be integers, got {row.dtype}")
            if row.size > self.max_length:
                raise ConfigError(
                    f"token_ids[{i}]: {row.size} tokens exceed max_length {self.max_length}; "
                    "shorten the input (tokenize() truncates text to fit)"
                )
        return rows


class TorchEncoder(_TokenizingEncoder):
    """The BERT encoder of a Hugging Face checkpoint directory, run in PyTorch: weights and
    activations in `dtype`, the linear layers in it or as `quantization` ("w8a8"), pooling and
    normalisation in float32. Warmed at load (a short batch and one row), so that the first
    request does not pay first-call costs.

    A batch runs as groups of rows of similar length (`length_groups`), each padded to its own
    longest row only, and unmasked where its rows are all one length."""

    def __init__(
        self,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        quantization: str | None = None,
    ) -> None:
        path = Path(path)
        config = load_bert_config(path)
        pooling = load_pooling_config(path)
        max_length = max_sequence_length(config, pooling)
        super().__init__(path, max_length, config.vocab_size, config.hidden_size)
        self.dtype = _torch_dtype(dtype)
        self.device = _torch_device(device)
        self.quantization = _quantization(quantization, self.device)
        if self.device.type == "cpu":
            retain_freed_memory()
        self.model = load_sentence_encoder(path, dtype=self.dtype, device=self.device)
        prepack_linears(self.model, self.quantization)
        self.warm()

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        rows = self._checked_rows(token_ids)
        lengths = np.fromiter((row.size for row in rows), dtype=np.int64, count=len(rows))
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for group in length_groups(lengths):
            out[group] = self._embed_padded([rows[i] for i in group])
        return out

    def warm(self) -> None:
        """Run a short batch and a single row through the model (thread pool start, oneDNN
        primitives, first-touch memory) before the first request."""
        self.embed([[0] * min(16, self.max_length)] * 8)
        self.embed([[0] * min(8, self.max_length)])

    def _embed_padded(self, rows: list[np.ndarray]) -> np.ndarray:
        input_ids, attention_mask = pad_rows(rows)
        ids = torch.from_numpy(input_ids).to(self.device)
        # Rows of one length need no mask: attention then runs unmasked (and faster).
        is_padded = len({row.size for row in rows}) > 1
        mask = torch.from_numpy(attention_mask).to(self.device) if is_padded else None
        with torch.inference_mode():
            return self.model(ids, mask).cpu().numpy()


def pad_rows(rows: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """int64 rows -> (input_ids, attention_mask), int64 [rows, longest row], zeros past each
    row's end."""
    lengths = np.fromiter((row.size for row in rows), dtype=np.int64, count=len(rows))
    # E.g. lengths [3, 1] -> mask [[1, 1, 1], [1, 0, 0]]; the flat ids fill the set cells
    # in row-major order, which is their order in the concatenation.
    mask = np.arange(lengths.max()) < lengths[:, None]
    input_ids = np.zeros(mask.shape, dtype=np.int64)
    input_ids[mask] = np.concatenate(rows)
    return input_ids, mask.astype(np.int64)


def length_groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Row indices grouped by length, longest first: each group holds the rows at least half
    as long as its longest (ties in input order), so padding a group to its longest row at
    most doubles a row's tokens, where one batch padded to the longest of all could multiply
    a short row's many times.

    E.g. lengths [10, 40, 12, 30, 25, 40] -> [[1, 5, 3, 4], [2, 0]]."""
    order = np.argsort(-lengths, kind="stable")
    # Descending lengths, negated to ascending for searchsorted.
    negated = -lengths[order]
    groups = []
    start = 0
    while start < len(order):
        # The first row shorter than half the group's longest (E.g. longest 40: length < 20).
        end = int(np.searchsorted(negated, -((lengths[order[start]] + 1) // 2), side="right"))
        groups.append(order[start:end])
        start = end
    return groups


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight is stored and multiplied the way `choose_method` picks for
    this device and `quantization` (on the CPU: qiao's packed float32 kernel, oneDNN, or W8A8
    int8 matmuls, the weight packed or quantized once), as qiao's LLM layers do. It carries
    what a method reads of `LinearBase`."""

    def __init__(self, linear: nn.Linear, quantization: str | None = None) -> None:
        super().__init__()
        self.input_size = linear.in_features
        self.output_size = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # Encoder batches are a few to a few hundred rows of tokens.
        self.method = choose_method(self.weight, quantization=quantization, batch_hint=64)
        self.method.prepare(self)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)  # type: ignore[arg-type]


def prepack_linears(model: nn.Module, quantization: str | None = None) -> None:
    """Swap every `nn.Linear` of `model` for a `PackedLinear` (for inference only: the ONNX
    export traces the plain model)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child, quantization))


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit
_TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> None:
    """Make this process's C heap keep the memory it frees (glibc only; elsewhere a no-op).

    By default glibc serves blocks over ~128 KiB to 32 MiB from fresh mappings, or returns
    the heap's free top to the OS, so every encoder batch faulted its activations in again:
    ~14,000 page faults per batch of 64 MiniLM rows, and ~25 % of its time (165 -> 130 ms,
    docs/benchmarks.md). With blocks up to 32 MiB from the heap and 1 GiB of free heap kept,
    the memory of one batch is reused by the next. Process-wide: in an encoder process that
    is the encoder alone."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


class OnnxEncoder(_TokenizingEncoder):
    """A version folder written by `qiao export onnx`, run in an onnxruntime CPU session.

    `num_threads` is the session's intra-op thread count (None: onnxruntime's default, one per
    core)."""

    def __init__(self, path: str | Path, num_threads: int | None = None) -> None:
        import onnxruntime as ort

        path = Path(path)
        self.metadata = OnnxEncoderMetadata.read(path)
        if num_threads is not None and num_threads < 1:
            raise ConfigError(f"num_threads: must be >= 1, got {num_threads}")
        super().__init__(
            path, self.metadata.max_length, self.metadata.vocab_size, self.metadata.dim
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads or 0
        options.inter_op_num_threads = 1
        model_file = _onnx_model_file(path)
        try:
            self._session = ort.InferenceSession(
                str(model_file), options, providers=["CPUExecutionProvider"]
            )
        except Exception as e:  # onnxruntime raises its own untyped failures
            raise ModelLoadError(f"{model_file}: onnxruntime cannot load it ({e})") from None
        inputs = tuple(i.name for i in self._session.get_inputs())
        outputs = tuple(o.name for o in self._session.get_outputs())
        if sorted(inputs) != sorted(ONNX_INPUTS) or outputs != (ONNX_OUTPUT,):
            raise ModelLoadError(
                f"{model_file}: graph has inputs {inputs} and outputs {outputs}; expected "
                f"{ONNX_INPUTS} and ({ONNX_OUTPUT!r},)"
            )

    def embed(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        input_ids, attention_mask = self._padded_batch(token_ids)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self._session.run([ONNX_OUTPUT], feeds)[0]


def load_encoder(
    path: Path,
    backend: Literal["embedding", "onnx"],
    precision: str = "FP32",
    device: str = "cpu",
    num_threads: int | None = None,
) -> Encoder:
    """The encoder of a repository version folder.

    backend "embedding": a Hugging Face checkpoint run in PyTorch at `precision` (FP32, FP16,
    BF16, or INT8: W8A8 linear layers on the CPU) on `device`; it shares the process's torch
    thread pool, so `num_threads` is not used. backend "onnx": a folder from `qiao export onnx`,
    FP32 on the CPU, `num_threads` intra-op threads."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision_mode: unsupported value {precision!r}; allowed: {', '.join(PRECISIONS)}"
        )
    if backend == "embedding":
        chosen = PRECISIONS[precision]
        if chosen.quantization is not None and _torch_device(device).type != "cpu":
            raise ConfigError(
                f"precision_mode: {precision} runs its int8 matmuls on the CPU; on {device!r} "
                "use FP16 or BF16"
            )
        return TorchEncoder(path, chosen.dtype, device, quantization=chosen.quantization)
    if backend == "onnx":
        if precision != "FP32":
            raise ConfigError(
                f"precision_mode: the onnx backend runs the exported FP32 graph; got {precision!r}"
            )
        if _torch_device(device).type != "cpu":
            raise ConfigError(f"hardware.device: the onnx backend runs on cpu, got {device!r}")
        return OnnxEncoder(path, num_threads=num_threads)
    raise ConfigError(f"backend: {backend!r} is not an encoder backend; allowed: {BACKENDS}")


def load_tokenizer(folder: Path, max_length: int) -> Tokenizer:
    """The fast tokenizer of `folder`, truncating to `max_length` tokens (special ones included)
    and never padding: the encoder pads each batch itself."""
    from tokenizers import Tokenizer

    path = folder / TOKENIZER_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: an encoder needs its fast tokenizer file")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"{path}: not a readable tokenizer ({e})") from None
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return tokenizer


def _onnx_model_file(folder: Path) -> Path:
    """model.onnx, else the folder's only .onnx file."""
    if (folder / ONNX_MODEL_FILE).is_file():
        return folder / ONNX_MODEL_FILE
    candidates = sorted(folder.glob("*.onnx"))
    if len(candidates) != 1:
        raise ModelLoadError(
            f"{folder}: expected {ONNX_MODEL_FILE} (or exactly one .onnx file), found "
            f"{len(candidates)} .onnx files"
        )
    return candidates[0]


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype: unsupported {dtype}; allowed: {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: unsupported value {dtype!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _quantization(quantization: str | None, device: torch.device) -> str | None:
    if quantization is None:
        return None
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization: unsupported value {quantization!r}; allowed: "
            f"{', '.join(QUANTIZATIONS)} or None"
        )
    if device.type != "cpu":
        raise ConfigError(f"quantization: {quantization} runs on the CPU, not on {device}")
    return quantization


def _torch_device(device: str) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: {device!r} requested but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device: {device!r} unsupported; use cpu or cuda[:N]")
    return resolved
