"""GGUF files from Hugging Face checkpoints, and `qiao bench gguf`: qiao against llama.cpp.

`write_gguf` lays a checkpoint out as llama.cpp's `convert_hf_to_gguf.py` does: its tensor names,
the llama arch's q/k rows permuted to adjacent rotary pairs, matrices in the chosen type (norms
and biases F32), the architecture and tokenizer under its metadata keys. The tests make their
files with it and check them against transformers' own GGUF reader; the benchmark makes the one
file both engines load.

`run_gguf_bench` loads that file in qiao and in llama-cpp-python (an optional extra:
`pip install "qiao[llamacpp]"`, which builds llama.cpp from source) and measures batch-1 decode
tokens/s and offline throughput on the same prompts, one engine at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# qiao architecture -> GGUF arch name (Mistral converts as llama).
_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K")


def write_gguf(checkpoint: str | Path, out: str | Path, file_type: str = "F32") -> Path:
    """Convert the Hugging Face checkpoint folder `checkpoint` to the GGUF file `out`, every
    matrix in `file_type` (one of FILE_TYPES; Q4_K needs input features in multiples of 256)."""
    import gguf
    from safetensors.torch import load_file

    from qiao.models.arch_config import load_arch_config

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r}; expected one of {FILE_TYPES}")
    checkpoint, out = Path(checkpoint), Path(out)
    arch = load_arch_config(checkpoint)
    name = _GGUF_ARCH[arch.architecture]
    config = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), name)
    writer.add_name(checkpoint.name)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_hidden_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_attention_heads)
    writer.add_head_count_kv(arch.num_key_value_heads)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    writer.add_rope_dimension_count(arch.rotary_dim)
    if arch.head_dim != arch.hidden_size // arch.num_attention_heads:
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    if arch.sliding_window is not None:
        writer.add_sliding_window(arch.sliding_window)
    writer.add_file_type(_FILE_TYPE_IDS[file_type])
    _add_tokenizer(writer, checkpoint, arch.vocab_size, config)

    weights = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(path))
    gguf_names = _gguf_names(name)
    for hf, tensor in weights.items():
        if arch.tie_word_embeddings and hf == "lm_head.weight":
            continue
        gguf_name = gguf_names(hf)
        data = tensor.float().numpy()
        if name == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute(data, arch.num_attention_heads)
        elif name == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute(data, arch.num_key_value_heads)
        kind = file_type if data.ndim == 2 else "F32"
        writer.add_tensor(gguf_name, *_encode(data, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_FILE_TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "BF16": 32}


def _gguf_names(arch: str) -> Callable[[str], str]:
    """Hugging Face name -> llama.cpp name (qiao.models.gguf's mapping, inverted)."""
    from qiao.models.gguf import _BLOCK_NAMES, _GLOBAL_NAMES, _PHI3_BLOCK_NAMES

    blocks = {hf: g for g, hf in (_PHI3_BLOCK_NAMES if arch == "phi3" else _BLOCK_NAMES).items()}
    globals_ = {hf: g for g, hf in _GLOBAL_NAMES.items()}

    def convert(name: str) -> str:
        base, _, leaf = name.rpartition(".")
        if base in globals_:
            return f"{globals_[base]}.{leaf}"
        _, _, rest = base.partition("model.layers.")
        layer, _, module = rest.partition(".")
        return f"blk.{layer}.{blocks[module]}.{leaf}"

    return convert


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rows as adjacent rotary pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _encode(data: np.ndarray, kind: str) -> tuple[np.ndarray, ...]:
    """(tensor, raw_shape, raw_dtype) arguments of GGUFWriter.add_tensor for `kind`."""
    from gguf import GGMLQuantizationType, quants

    if kind == "F32":
        return (data.astype(np.float32),)
    if kind == "F16":
        return (data.astype(np.float16),)
    qtype = GGMLQuantizationType[kind]
    if kind == "Q4_K":
        return quantize_q4_k(data), None, qtype
    return quants.quantize(data, qtype), None, qtype


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q4_K bytes [N, K / 256 * 144], min/max per
    sub-block of 32 (the gguf package has no Q4_K quantizer; llama.cpp's searches its scales,
    this one does not, but it writes the same format)."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K needs input features in multiples of 256, got {k}")
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # [N, B, 8], <= 0 so the min is an offset >= 0
    scale = (sub.max(axis=-1) - low) / 15.0
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63.0  # [N, B]
    dmin = np.maximum((-low).max(axis=-1), 1e-12) / 63.0
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.round((sub + offset[..., None]) / np.maximum(step, 1e-30)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # sub-blocks 2c (low) and 2c+1 (high nibble)
    packed = np.empty((n, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    blocks = np.concatenate(
        [
            d[..., None].view(np.uint8),
            dmin[..., None].view(np.uint8),
            packed,
            qs.reshape(n, k // 256, 128),
        ],
        axis=-1,
    )
    return blocks.reshape(n, -1)


def _add_tokenizer(writer: Any, checkpoint: Path, vocab_size: int, config: dict) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary: tokens in id order
    (padded to the model's vocabulary), merges, token types (special ones CONTROL), the
    special ids and the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model["type"] != "BPE":
        raise ValueError(f"write_gguf writes byte-level BPE tokenizers, not {model['type']}")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_ids)
    types = [
        3 if i in special else (5 if i not in by_id else 1)  # CONTROL, UNUSED, NORMAL
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
    ):
        token_id = getattr(tokenizer, key, None)
        if token_id is None:
            token_id = config.get(key)
        if isinstance(token_id, int):
            add(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)
