"""GGUF checkpoints (llama.cpp's single-file format, read with the `gguf` package).

One `.gguf` file carries the architecture (metadata under `<arch>.*`), the tokenizer
(`tokenizer.ggml.*`, `tokenizer.chat_template`) and the tensors under llama.cpp's names. This
module turns each into qiao's form:

- `read_gguf_arch_config`: the metadata as an `ArchConfig` (llama, qwen2, qwen3, phi3,
  qwen2moe, qwen3moe).
- `iter_gguf_weights`: (Hugging Face name, float tensor) of every tensor, llama.cpp's names mapped
  back (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`) and, for the llama
  arch, the q/k row permutation of llama.cpp's converter undone. F32 / F16 / BF16 load as they
  are; Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q6_K are decoded exactly (qiao.models.gguf_quants:
  vectorised, no per-block loops).
- `gguf_int4_weights`: a Q4_0 / Q4_1 / Q4_K tensor as `Int4Weights` (codes, per-32 scales and offsets),
  the 4-bit path's form, without a detour through float.
The tokenizer is built in qiao.gguf_file (below the layers, for qiao.tokenizer).

One linear method serves every layer (`gguf_quantization`). A file with Q4 matrices is int4: its
Q4 matrices go on as they are and its wider ones (Q6_K, Q5_*, Q8_0: the mixes "Q4_K_M" files
make) are decoded exactly, then requantized onto int4 in groups of 32, one more rounding that
keeps every layer on the fast 4-bit kernels. A file whose widest codes are Q5 / Q6 / Q8 is int8:
the exact weights are handed to `Int8Method`, which rounds them per output channel. docs/gguf.md
gives the measured cost of both.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from qiao.errors import ModelLoadError
from qiao.gguf_file import NO_TOKEN_ID, open_gguf_reader
from qiao.layers.quant_int4 import (
    FALLBACK_GROUP_SIZE,
    Int4Weights,
    attach_int4_weights,
    quantize_int4,
)
from qiao.models.arch_config import ArchConfig
from qiao.models.gguf_quants import FLOAT_DECODERS, INT4_DECODERS

logger = logging.getLogger("qiao.loader")

# GGUF `general.architecture` -> qiao architecture (Mistral converts as "llama").
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_MOE_ARCHS = ("qwen2moe", "qwen3moe")
FLOAT_TYPES = ("F32", "F16", "BF16")
INT4_TYPES = tuple(INT4_DECODERS)  # Q4_0, Q4_1, Q4_K: onto the int4 path as they are
# Decoded to float: on the int8 path in a file without Q4 matrices, requantized onto int4 in one
# with them (see `gguf_quantization`).
WIDE_TYPES = tuple(FLOAT_DECODERS)  # Q8_0, Q5_0, Q5_1, Q5_K, Q6_K
QUANT_TYPES = INT4_TYPES + WIDE_TYPES
SUPPORTED_TYPES = FLOAT_TYPES + QUANT_TYPES
# The architectures whose q/k rows llama.cpp's converter permutes (rotary on adjacent pairs).
_PERMUTED_ARCHS = ("llama",)

# GGUF tensor names -> Hugging Face names; per-block names under `blk.N.`.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k, v stacked
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, the shared expert and its gate (Qwen2-MoE).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The routed experts, stacked [experts, out, in]: loaded as each expert's own tensor.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# Phi-3's ffn_up holds gate and up stacked (its checkpoint's gate_up_proj).
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFFile:
    """A parsed file: its metadata (key -> plain value) and tensors by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    @property
    def arch(self) -> str:
        return self.metadata.get("general.architecture", "")

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>` from the metadata."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def open_gguf(path: str | Path) -> GGUFFile:
    metadata, reader = open_gguf_reader(path)
    return GGUFFile(Path(reader.data.filename), metadata, {t.name: t for t in reader.tensors})


# --- architecture -----------------------------------------------------------------------------


def read_gguf_arch_config(path: str | Path) -> ArchConfig:
    """The file's metadata as an ArchConfig (through `ArchConfig.from_dict`'s checks)."""
    f = open_gguf(path)
    if f.arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{f.path.name}: GGUF architecture {f.arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        raise ModelLoadError(
            f"{f.path.name}: LongRoPE factors (rope_factors_long / rope_factors_short, Phi-3 "
            "128k) are not supported from GGUF yet; load the Hugging Face checkpoint"
        )
    heads = _meta_int(f, "attention.head_count")
    hidden = _meta_int(f, "embedding_length")
    head_dim = f.get("attention.key_length") or hidden // heads
    rope_dim = f.get("rope.dimension_count") or head_dim
    tokens = f.metadata.get("tokenizer.ggml.tokens")
    window = f.get("attention.sliding_window") or None
    architecture = ARCHITECTURES[f.arch]
    if f.arch == "llama" and window is not None:
        architecture = "MistralForCausalLM"  # llama.cpp's llama arch with a window: Mistral
    config = {
        "architectures": [architecture],
        "model_type": f.arch,
        "vocab_size": f.get("vocab_size") or _rows(f, "token_embd.weight") or len(tokens or ()),
        "hidden_size": hidden,
        "intermediate_size": _intermediate_size(f),
        "num_hidden_layers": _meta_int(f, "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.get("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "partial_rotary_factor": rope_dim / head_dim,
        "max_position_embeddings": f.get("context_length", 2048),
        "rms_norm_eps": float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(f),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors or "blk.0.attn_qkv.bias" in f.tensors,
        "sliding_window": window,
        "hidden_act": "silu",
        "bos_token_id": _token_id(f, "bos_token_id"),
        "eos_token_id": _token_id(f, "eos_token_id"),
        "torch_dtype": _float_dtype(f),
        **_moe_config(f),
    }
    return ArchConfig.from_dict(config)


def _moe_config(f: GGUFFile) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE: experts per layer and per token, their sizes; a layer without a
    router (`ffn_gate_inp`) is dense. llama.cpp renormalises the top-k weights for qwen3moe
    unless `expert_weights_norm` says otherwise, never for qwen2moe."""
    if f.arch not in _MOE_ARCHS:
        return {}
    layers = _meta_int(f, "block_count")
    return {
        "num_experts": _meta_int(f, "expert_count"),
        "num_experts_per_tok": _meta_int(f, "expert_used_count"),
        "moe_intermediate_size": _meta_int(f, "expert_feed_forward_length"),
        "shared_expert_intermediate_size": f.get("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": bool(f.get("expert_weights_norm", f.arch == "qwen3moe")),
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors
        ],
    }


def _meta_int(f: GGUFFile, key: str) -> int:
    value = f.get(key)
    if value is None:
        raise ModelLoadError(f"{f.path.name}: GGUF metadata lacks {f.arch}.{key}")
    return int(value)


def _rows(f: GGUFFile, name: str) -> int | None:
    tensor = f.tensors.get(name)
    return None if tensor is None else int(tensor.shape[-1])


def _intermediate_size(f: GGUFFile) -> int:
    if f.get("feed_forward_length") is None and f.arch in _MOE_ARCHS:
        return _meta_int(f, "expert_feed_forward_length")  # no dense layer
    size = _meta_int(f, "feed_forward_length")
    return size[0] if isinstance(size, list) else size


def _rope_scaling(f: GGUFFile) -> dict | None:
    """`rope.scaling.type` linear, or `rope_freqs.weight`: the per-frequency divisors of the
    inverse frequencies that llama.cpp's converter writes for Llama 3.1 / 3.2's "llama3"
    scaling (qiao.layers.rotary's "freq_factors")."""
    kind = f.get("rope.scaling.type")
    factors = f.tensors.get("rope_freqs.weight")
    if factors is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(
                f"{f.path.name}: rope_freqs with RoPE scaling {kind!r} is not supported"
            )
        values = dequantize_tensor(factors, "rope_freqs.weight").float().reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": values.tolist()}
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(
            f"{f.path.name}: RoPE scaling {kind!r} from GGUF is not supported (linear is)"
        )
    return {"rope_type": "linear", "factor": float(f.get("rope.scaling.factor", 1.0))}


def _token_id(f: GGUFFile, key: str) -> int | None:
    value = f.metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None or value == NO_TOKEN_ID else int(value)


def _float_dtype(f: GGUFFile) -> str:
    """The checkpoint's float dtype: F16 / BF16 when its matrices are, else float32 (F32 and
    the quantized types, whose scales llama.cpp computes with in float32)."""
    types = {t.tensor_type.name for t in f.tensors.values() if len(t.shape) == 2}
    for name, dtype in (("BF16", "bfloat16"), ("F16", "float16")):
        if name in types:
            return dtype
    return "float32"


def gguf_quantization(path: str | Path) -> str | None:
    """The linear layers' path for the file's matrices: "int4" when any is Q4_0 / Q4_1 / Q4_K (its
    wider ones are requantized onto int4, `_attach_int4`), else "int8" when any is Q8_0, Q5_0,
    Q5_1, Q5_K or Q6_K, else None (float)."""
    f = open_gguf(path)
    types = {
        t.tensor_type.name
        for name, t in f.tensors.items()
        if name.startswith("blk.") and len(t.shape) == 2
    }
    if types & set(INT4_TYPES):
        return "int4"
    return "int8" if types & set(WIDE_TYPES) else None


# --- weights ----------------------------------------------------------------------------------


def load_gguf_checkpoint(
    model: nn.Module, path: str | Path, quantization: str | None
) -> str | None:
    """Fill `model` (built from `read_gguf_arch_config(path)`) from the file; returns the
    quantization its linear layers take: the one asked for, else the file's own
    (`gguf_quantization`; on int4 the codes and scales are attached to the layers)."""
    f = open_gguf(path)
    loaded = model.load_weights(iter_gguf_weights(f.path))
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{f.path.name} lacks tensor(s) for: {shown}")
    if quantization is None:
        quantization = gguf_quantization(f.path)
        if quantization is not None:
            logger.info("%s: linear layers on the %s path", f.path.name, quantization)
    if quantization == "int4":
        _attach_int4(model, f.path)
    return quantization


def _attach_int4(model: nn.Module, path: Path) -> None:
    """Hand each layer its 4-bit weights (a tied head: the embedding's): a Q4 matrix's codes and
    scales as they are, a wider quantized one (Q6_K, Q5_*, Q8_0) decoded exactly and
    requantized in groups of 32, the group Q4 matrices have, so that a fused layer whose parts
    differ (a Q4_K q and k beside a Q6_K v) stacks them. Float matrices stay float."""
    from qiao.layers.linear import LinearBase
    from qiao.models.llama import _param_name

    attached = set()
    tied = model.arch.tie_word_embeddings
    for name, weights in gguf_int4_weights(path, requantize=True):
        if tied and name == "model.embed_tokens.weight":
            name = "lm_head.weight"  # the tied head reads the embedding's codes
        param_name, shard_id = _param_name(name)
        module = model.get_submodule(param_name.rpartition(".")[0])
        if isinstance(module, LinearBase):
            attach_int4_weights(module, weights, shard_id)
            attached.add(module)
    for module in model.modules():
        if isinstance(module, LinearBase) and module not in attached:
            module.__dict__["int4_keep_dense"] = True


def hf_name(gguf_name: str, arch: str) -> str:
    """llama.cpp tensor name -> Hugging Face parameter name."""
    base, _, leaf = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{leaf}"
    match = _BLOCK_RE.fullmatch(gguf_name)
    names = _PHI3_BLOCK_NAMES if arch == "phi3" else _BLOCK_NAMES
    if match is None or match.group(2) not in names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in a {arch} model")
    layer, part, leaf = match.groups()
    return f"model.layers.{layer}.{names[part]}.{leaf}"


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float tensor) of every tensor in the file, rows unpermuted."""
    f = open_gguf(path)
    arch = read_gguf_arch_config(f.path)
    for name, tensor in f.tensors.items():
        if name == "rope_freqs.weight":  # read into the config's rope_scaling
            continue
        weight = dequantize_tensor(tensor, name)
        match = _BLOCK_RE.fullmatch(name)
        if match is not None and match.group(2) in _EXPERT_NAMES:
            layer, part = match.group(1), _EXPERT_NAMES[match.group(2)]
            for expert, rows in enumerate(weight):
                yield f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight", rows
            continue
        yield hf_name(name, f.arch), _unpermute(f, arch, name, weight)


def gguf_int4_weights(
    path: str | Path, requantize: bool = False
) -> Iterator[tuple[str, Int4Weights]]:
    """(Hugging Face name, Int4Weights) of every Q4_0 / Q4_1 / Q4_K matrix, rows unpermuted; with
    `requantize` also of every other quantized matrix, decoded and requantized (`quantize_int4`,
    groups of 32)."""
    f = open_gguf(path)
    arch = read_gguf_arch_config(f.path)
    for name, tensor in f.tensors.items():
        kind = tensor.tensor_type.name
        if len(tensor.shape) != 2:  # stacked experts: decoded to float (`iter_gguf_weights`)
            continue
        if kind in INT4_TYPES:
            raw = _from_numpy(np.asarray(tensor.data))
            parts = INT4_DECODERS[kind](raw)
            codes, scales, offsets = (_unpermute(f, arch, name, t) for t in parts)
            yield hf_name(name, f.arch), Int4Weights(codes, scales, offsets, FALLBACK_GROUP_SIZE)
        elif requantize and kind in WIDE_TYPES and _feeds_a_linear(f, name):
            weight = _unpermute(f, arch, name, dequantize_tensor(tensor, name))
            yield hf_name(name, f.arch), quantize_int4(weight, FALLBACK_GROUP_SIZE)


def _feeds_a_linear(f: GGUFFile, name: str) -> bool:
    """Whether a matrix is a linear layer's: any but the embedding, unless the head is tied
    to it."""
    return name != "token_embd.weight" or "output.weight" not in f.tensors


def dequantize_tensor(tensor: Any, name: str = "") -> torch.Tensor:
    """One GGUF tensor as a torch tensor of its logical shape (rows first): F32 / F16 / BF16 as
    stored (zero-copy where possible), the quantized types decoded to float32."""
    kind = tensor.tensor_type.name
    data = np.asarray(tensor.data)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne innermost-first
    if kind == "F32":
        return _from_numpy(data.reshape(shape))
    if kind == "F16":
        return _from_numpy(data.reshape(shape))
    if kind == "BF16":
        return _from_numpy(data.view(np.int16).reshape(shape)).view(torch.bfloat16)
    if kind in QUANT_TYPES:
        raw = _from_numpy(data.reshape(-1, data.shape[-1]))
        return _decode_in_chunks(kind, raw).reshape(shape)
    raise ModelLoadError(
        f"GGUF tensor {name!r} is of type {kind}, which qiao does not load; supported: "
        f"{', '.join(SUPPORTED_TYPES)} (requantize the file, e.g. with llama-quantize)"
    )


# Weights decoded at a time. A decoder's temporaries (codes, high bits, float copies) peak at
# ~2.6x its output's float32 size (Q6_K, 32768 x 4096: +1353 MiB whole, +726 MiB in chunks),
# so a whole 128k x 4096 head would peak near 5.5 GB. Chunks of 16M weights bound that to
# ~170 MB over the output, for a time from even to 1.5x the whole decode's (2 loaded cores,
# medians of 3-5: 0.69 s against 0.71 s, 1.20 s against 0.81 s).
_DECODE_WEIGHTS_PER_CHUNK = 1 << 24


def _decode_in_chunks(kind: str, raw: torch.Tensor) -> torch.Tensor:
    """Quantized rows [N, bytes] -> float32 [N, K], decoded `_DECODE_WEIGHTS_PER_CHUNK`
    weights at a time into one output."""
    first = _decode_rows(kind, raw[:1])
    out = torch.empty(raw.shape[0], first.shape[1])
    rows = max(1, _DECODE_WEIGHTS_PER_CHUNK // first.shape[1])
    for start in range(0, raw.shape[0], rows):
        out[start : start + rows] = _decode_rows(kind, raw[start : start + rows])
    return out


def _decode_rows(kind: str, raw: torch.Tensor) -> torch.Tensor:
    if kind in FLOAT_DECODERS:
        return FLOAT_DECODERS[kind](raw)
    codes, scales, offsets = INT4_DECODERS[kind](raw)
    groups = codes.float().reshape(codes.shape[0], -1, 32)
    return (groups * scales[..., None] - offsets[..., None]).reshape(codes.shape[0], -1)


def _from_numpy(data: np.ndarray) -> torch.Tensor:
    """A zero-copy view of the read-only memory map (only ever copied from, never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(data)


def _unpermute(f: GGUFFile, arch: ArchConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for the llama arch: its converter stores each head's rows
    as adjacent rotary pairs (row 2i + j of a head is Hugging Face's row j * D/2 + i, D the
    head size), the layout its rotary kernel expects. Any row-aligned tensor (weight, bias,
    int4 codes, scales) is reordered the same way."""
    if f.arch not in _PERMUTED_ARCHS or not name.endswith(
        ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")
    ):
        return t
    heads = arch.num_attention_heads if ".attn_q." in name else arch.num_key_value_heads
    rest = t.shape[1:]
    # E.g. one head of D = 4: rows [a0, b0, a1, b1] -> [a0, a1, b0, b1].
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *rest).transpose(1, 2).reshape(t.shape)
