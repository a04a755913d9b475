"""Build a model on the meta device and fill it from memory-mapped safetensors.

Pickle checkpoints (`*.bin`, `*.pt`, `*.pth`) are refused: unpickling can run arbitrary code.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from qiao.errors import ConfigError, ModelLoadError
from qiao.gguf_file import is_gguf_path
from qiao.layers.fused_moe import prepare_experts
from qiao.layers.int4_checkpoint import int4_checkpoint_quantization
from qiao.layers.linear import prepare_linears
from qiao.logs import Progress
from qiao.models import gguf
from qiao.models.arch_config import ArchConfig
from qiao.models.registry import get_model_class

logger = logging.getLogger("qiao.loader")

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_DUMMY_SEED = 0


def load_model(
    model_dir: str | Path | None,
    arch: ArchConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    quantization: str | None = None,
    batch_hint: int = 128,
    batch_invariant: bool = False,
) -> nn.Module:
    """The model of `arch` on `device` in `dtype`, weights loaded, in eval mode.

    load_format "dummy" needs no checkpoint: small deterministic random weights (benchmarks);
    "gguf" (or "auto" given a `.gguf` path) reads a llama.cpp file (qiao.models.gguf), whose
    Q8_0 / Q4 matrices choose the int8 / int4 path when `quantization` is None.
    Once loaded, every linear layer prepares its weights for the device (`prepare_linears`):
    packed for the CPU's matmul library, or int8 with `quantization="int8"`; `batch_hint` is the
    typical number of rows per matmul (the running-sequence limit). `batch_invariant`: every
    row's result independent of the rows beside it (linear_method, CPU only).
    """
    if load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"load_format: unsupported value {load_format!r}; allowed: {', '.join(LOAD_FORMATS)}"
        )
    if load_format != "dummy" and model_dir is None:
        raise ModelLoadError(f"load_format {load_format!r} needs a model directory")
    # An AWQ / GPTQ checkpoint is int4 (its layers get their weights as they are).
    quantization = int4_checkpoint_quantization(arch.quantization_config, quantization)
    with torch.device("meta"):
        model = get_model_class(arch)(arch)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    if load_format == "dummy":
        init_dummy_weights(model)
    elif load_format == "gguf" or (load_format == "auto" and is_gguf_path(model_dir)):
        quantization = gguf.load_gguf_checkpoint(model, model_dir, quantization)
    else:
        _load_checkpoint(model, Path(model_dir))
    prepare_linears(
        model, quantization=quantization, batch_hint=batch_hint, batch_invariant=batch_invariant
    )
    prepare_experts(
        model, quantization=quantization, batch_hint=batch_hint, batch_invariant=batch_invariant
    )
    return model.eval()


def find_weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of its index, or its single file."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _index_shards(index)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); they are refused "
            "for safety (unpickling can run arbitrary code). Convert them to safetensors "
            f"({SINGLE_FILE}) first."
        )
    raise ModelLoadError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE}")


def init_dummy_weights(model: nn.Module, seed: int = _DUMMY_SEED) -> None:
    """Fill every parameter in place: norm weights U(0.9, 1.1), the rest U(-0.01, 0.01)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if param.device not in generators:
            generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        generator = generators[param.device]
        if name.endswith("norm.weight"):
            param.data.uniform_(0.9, 1.1, generator=generator)
        else:
            param.data.uniform_(-0.01, 0.01, generator=generator)


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in `files`, memory-mapped on the CPU. A load that takes a
    while logs its progress in checkpoint bytes every few seconds (`qiao.logs.Progress`)."""
    sizes = {path: path.stat().st_size for path in files}
    progress = Progress(
        logger, f"loading weights from {len(files)} file(s)", sum(sizes.values()) / 1e6, "MB"
    )
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensor = f.get_tensor(name)
                    yield name, tensor
                    progress.advance(tensor.numel() * tensor.element_size() / 1e6)
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
    progress.done()


def _load_checkpoint(model: nn.Module, model_dir: Path) -> None:
    loaded = model.load_weights(iter_safetensors(find_weight_files(model_dir)))
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"checkpoint in {model_dir} lacks tensor(s): {shown}")


def _index_shards(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({e!r})") from None
    shards = [index.parent / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"shard {shard} listed in {index} not found")
    return shards
