"""AWQ and GPTQ checkpoints: their `quantization_config` and 4-bit tensors, read into the
shared `Int4Weights` form (qiao/layers/quant_int4.py) and attached to the model's layers while it
loads, so the layers' int4 method packs them as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qiao.errors import ConfigError, ModelLoadError
from qiao.layers.quant_int4 import Int4Weights, attach_int4_weights

if TYPE_CHECKING:
    from qiao.layers.linear import LinearBase


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """A pre-quantized checkpoint's `quantization_config` (config.json), as qiao reads it.

    AWQ (GEMM): qweight int32 [K, N/8], eight codes along N per word, nibble i holding column
    8c + AWQ_ORDER[i]; qzeros int32 [K/g, N/8] packed alike; scales [K/g, N]; w = (q - z) s.
    GPTQ: qweight int32 [K/8, N], nibble j of word i holding input feature 8i + j; qzeros
    [K/g, N/8], nibble j holding column 8c + j, stored as z - 1 unless `checkpoint_format` is
    gptq_v2; scales [K/g, N]; g_idx [K], the group of each input feature."""

    method: str  # "awq" or "gptq"
    group_size: int  # -1: one group of all input features
    zero_plus_one: bool  # GPTQ v1: the stored zero is z - 1


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INT4_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def read_int4_checkpoint_format(config: dict | None) -> Int4CheckpointFormat | None:
    """`quantization_config` of config.json -> its format, None for a float checkpoint; a
    ModelLoadError saying what is supported for any other quantization."""
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelLoadError(
            f"quantization_config.quant_method {method or None!r} is not supported; qiao reads "
            "4-bit AWQ (GEMM) and GPTQ checkpoints, or quantizes a float checkpoint itself "
            "(--quantization int8 / int4)"
        )
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{method} checkpoint of {bits} bits: qiao reads 4-bit ones only")
    group_size = config.get("group_size", config.get("q_group_size", -1))
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ModelLoadError(f"{method} quantization_config.group_size {group_size!r} is invalid")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                f"AWQ checkpoint in the {version!r} layout: qiao reads AWQ's GEMM layout only"
            )
        if not config.get("zero_point", True):
            raise ModelLoadError("AWQ checkpoint without zero points: not supported")
        return Int4CheckpointFormat("awq", group_size, zero_plus_one=False)
    v2 = str(config.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    return Int4CheckpointFormat("gptq", group_size, zero_plus_one=not v2)


def int4_checkpoint_quantization(
    fmt: Int4CheckpointFormat | None, quantization: str | None
) -> str | None:
    """The quantization a model loads with: "int4" for an AWQ / GPTQ checkpoint (a conflicting
    explicit choice is a ConfigError), else `quantization` as given."""
    if fmt is None:
        return quantization
    if quantization not in (None, "int4"):
        raise ConfigError(
            f"quantization {quantization!r} given for a {fmt.method.upper()} checkpoint, which "
            "is int4 already: leave quantization unset (or int4)"
        )
    return "int4"


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.to(torch.int32)[..., None] >> shifts) & 15).to(torch.uint8)


def decode_int4_checkpoint(
    fmt: Int4CheckpointFormat, tensors: dict[str, torch.Tensor]
) -> Int4Weights:
    """One layer's qweight / qzeros / scales (/ g_idx) in `fmt` -> Int4Weights [N, K]."""
    qweight, qzeros, scales = (tensors[n] for n in ("qweight", "qzeros", "scales"))
    if fmt.method == "awq":
        k = qweight.shape[0]
        reverse = [AWQ_ORDER.index(j) for j in range(8)]  # column 8c + j is nibble reverse[j]
        codes = _nibbles(qweight)[..., reverse].reshape(k, -1)
        zeros = _nibbles(qzeros)[..., reverse].reshape(qzeros.shape[0], -1)
    else:
        n = qweight.shape[1]
        codes = _nibbles(qweight).transpose(1, 2).reshape(-1, n)  # [K/8, N, 8] -> [K, N]
        zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1)
    k, n = codes.shape
    groups = scales.shape[0]
    if zeros.shape != (groups, n) or scales.shape[1] != n or k % groups:
        raise ModelLoadError(
            f"{fmt.method} tensors do not fit: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    group_size = k // groups
    if fmt.group_size not in (-1, group_size):
        raise ModelLoadError(
            f"{fmt.method} tensors in groups of {group_size}, quantization_config says "
            f"{fmt.group_size}"
        )
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group_size):
        raise ModelLoadError(
            "GPTQ checkpoint with act-order (desc_act: g_idx not in input order): not supported; "
            "use one quantized with desc_act false"
        )
    s = scales.float().t().contiguous()
    z = zeros.float().t() + (1.0 if fmt.zero_plus_one else 0.0)
    return Int4Weights(codes.t().contiguous(), s, z * s, group_size)


class Int4CheckpointReader:
    """Collects an AWQ / GPTQ checkpoint's int4 tensors while a model loads, then attaches each
    layer's weights (`attach`). `take` claims the names ending in qweight, qzeros, scales,
    g_idx; every other tensor loads as usual."""

    def __init__(self, fmt: Int4CheckpointFormat) -> None:
        self.fmt = fmt
        self.layers: dict[str, dict[str, torch.Tensor]] = {}

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in _INT4_TENSORS:
            return False
        self.layers.setdefault(prefix, {})[leaf] = tensor
        return True

    def attach(
        self,
        model: torch.nn.Module,
        target: Callable[[str], tuple[LinearBase, str | int | None]],
    ) -> set[str]:
        """Attach every collected layer to `target(checkpoint weight name)` (its layer and shard
        id); returns those weight names, now loaded. Linear layers given none (the head) keep
        their float weights (`Int4Method` leaves them dense)."""
        from qiao.layers.linear import LinearBase

        names = set()
        for prefix, tensors in self.layers.items():
            missing = [n for n in _INT4_TENSORS[:3] if n not in tensors]
            if missing:
                raise ModelLoadError(
                    f"{self.fmt.method} layer {prefix!r} lacks {', '.join(missing)}"
                )
            layer, shard_id = target(f"{prefix}.weight")
            try:
                attach_int4_weights(layer, decode_int4_checkpoint(self.fmt, tensors), shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"{self.fmt.method} layer {prefix!r}: {e}") from None
            names.add(f"{prefix}.weight")
        for module in model.modules():
            if isinstance(module, LinearBase) and "int4_parts" not in module.__dict__:
                module.int4_keep_dense = True
        return names
