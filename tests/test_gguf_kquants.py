"""GGUF breadth: the Q5 / Q6 block formats and Llama 3.1's per-frequency RoPE factors.

References: gguf.quants.dequantize (the gguf package's own decoders: bit for bit), transformers'
GGUF loader (its dequantization and q/k unpermutation of a whole file), the float32 source
checkpoint through transformers (logits, greedy tokens). The Q6_K encoder below is this test's
own (the gguf package has none): a plain max-abs quantizer in the block layout.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import _randomize, _train_tokenizer, build_attn_metadata, build_llama256_checkpoint
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
from safetensors.torch import load_file

from qiao.bench.gguf import write_gguf
from qiao.entrypoints.llm import LLM
from qiao.layers.linear import LinearBase
from qiao.models import load_arch_config, load_model
from qiao.models.gguf import gguf_quantization, read_gguf_arch_config
from qiao.models.gguf_quants import FLOAT_DECODERS, decode_q4_1
from qiao.sampling_params import SamplingParams

PROMPT = [1, 5, 9, 33, 77, 120, 4, 200, 17, 250, 3, 64, 99, 12, 180, 41]
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q6_K": 210}
# Byte ranges of each block's f16 scales (random bytes there could be inf / NaN).
F16_FIELDS = {"Q5_0": [0], "Q5_1": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


# --- a Q6_K encoder (test blocks) -------------------------------------------------------------


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q6_K bytes [N, K / 256 * 210]: per 16 weights a
    scale max|w| / 31, the 16 scales as int8 multiples of d = their max / 127 (f16), codes
    round(w / (d sc)) in -32..31 stored + 32 as 4 + 2 bits."""
    n, k = w.shape
    sub = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(axis=-1) / 31  # [N, blocks, 16]
    d = (scale.max(axis=-1) / 127).astype(np.float16)  # [N, blocks]
    d32 = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.round(scale / d32), 0).clip(0, 127).astype(np.int8)
        step = (d32 * sc.astype(np.float32))[..., None]
        q = np.where(step > 0, np.round(sub / step), 0).clip(-32, 31)
    # Element 128 h + 32 j + l: its low nibble in byte 64 h + 32 (j % 2) + l (high nibble for
    # j >= 2), its top 2 bits at bits 2j of byte 32 h + l of qh.
    u = (q + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)
    low, high = u & 0x0F, u >> 4
    ql = (low[:, :, :, :2] | (low[:, :, :, 2:] << 4)).reshape(n, -1, 128)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)
    blocks = [ql, qh.reshape(n, -1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, -1, 2)]
    return np.concatenate(blocks, axis=-1).reshape(n, -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q5_K bytes [N, K / 256 * 176]: per 32 weights
    min/max on 31 steps, the 8 scales and mins as 6-bit multiples of d and dmin (f16), codes
    0..31 as a low nibble plus one high bit."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # <= 0: the offset dmin m is >= 0
    scale = (sub.max(axis=-1) - low) / 31
    d = (np.maximum(scale.max(axis=-1), 1e-12) / 63).astype(np.float16)
    dmin = (np.maximum((-low).max(axis=-1), 1e-12) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = np.maximum(d.astype(np.float32)[..., None] * sc, 1e-30)[..., None]
    offset = (dmin.astype(np.float32)[..., None] * m)[..., None]
    q = np.clip(np.round((sub + offset) / step), 0, 31).astype(np.uint8)  # [N, B, 8, 32]
    packed = np.empty((n, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    # Sub-block s takes bit s of qh[l]; sub-blocks 2c and 2c+1 the nibbles of qs[32c + l].
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)
    nibbles = (q & 0x0F).reshape(n, k // 256, 4, 2, 32)
    qs = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).reshape(n, -1, 128)
    header = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed]
    return np.concatenate([*header, qh, qs], axis=-1).reshape(n, -1)


def _random_blocks(kind: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `kind`'s block layout, its f16 scales finite."""
    raw = rng.integers(0, 256, (rows, blocks, BLOCK_BYTES[kind]), dtype=np.uint8)
    for start in F16_FIELDS[kind]:
        scales = rng.uniform(-0.05, 0.05, (rows, blocks)).astype(np.float16)
        raw[..., start : start + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_block_decoders_equal_gguf_dequantize(kind):
    """Every bit pattern of codes, high bits and (K-quants) packed scales: bit for bit."""
    rng = np.random.default_rng(1)
    weights = 256 if kind.endswith("K") else 32
    raw = _random_blocks(kind, 7, 1024 // weights, rng)
    qtype = GGMLQuantizationType[kind]
    if kind in ("Q5_0", "Q5_1"):  # and the gguf package's own encoding of real weights
        w = rng.standard_normal((7, 1024)).astype(np.float32)
        raw = np.concatenate([raw, quants.quantize(w, qtype)])
    expected = quants.dequantize(raw, qtype)
    got = FLOAT_DECODERS[kind](torch.from_numpy(raw))
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), expected)


def test_q4_1_decodes_to_int4_codes_equal_to_gguf_dequantize():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 512)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q4_1)
    raw = np.concatenate([raw, rng.integers(0, 256, raw.shape, dtype=np.uint8)])
    blocks = raw.reshape(12, -1, 20)
    blocks[..., :4] = rng.uniform(-0.1, 0.1, (12, 16, 2)).astype(np.float16).view(np.uint8)
    codes, scales, offsets = decode_q4_1(torch.from_numpy(raw))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    got = codes.float().reshape(12, -1, 32) * scales[..., None] - offsets[..., None]
    expected = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    assert np.array_equal(got.reshape(expected.shape).numpy(), expected)


def test_q5_k_encoder_round_trips_through_gguf():
    w = np.random.default_rng(6).standard_normal((4, 512)).astype(np.float32)
    raw = quantize_q5_k(w)
    back = quants.dequantize(raw, GGMLQuantizationType.Q5_K)
    sub = w.reshape(4, -1, 32)
    step = (sub.max(axis=-1, keepdims=True) - np.minimum(sub.min(axis=-1, keepdims=True), 0)) / 31
    assert (np.abs(back - w).reshape(4, -1, 32) <= 1.5 * step).all()
    assert np.array_equal(FLOAT_DECODERS["Q5_K"](torch.from_numpy(raw)).numpy(), back)


def test_q6_k_encoder_round_trips_through_gguf():
    """The test encoder's blocks decode (gguf's decoder) to within half a step of the input."""
    w = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    raw = quantize_q6_k(w)
    back = quants.dequantize(raw, GGMLQuantizationType.Q6_K)
    step = np.abs(w).reshape(4, -1, 16).max(axis=-1, keepdims=True) / 31
    assert (np.abs(back - w).reshape(4, -1, 16) <= 0.6 * step + 1e-6).all()
    assert np.array_equal(FLOAT_DECODERS["Q6_K"](torch.from_numpy(raw)).numpy(), back)


# --- files ------------------------------------------------------------------------------------


def rewrite_gguf(
    source: Path, out: Path, replace: dict[str, tuple[np.ndarray, GGMLQuantizationType]]
) -> Path:
    """A copy of `source` with every metadata field and tensor, `replace`'s tensors (raw bytes
    of their type, or float data with type F32) in place of the file's or added."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        if t.name in replace:
            continue
        data = np.asarray(t.data).copy()
        if t.tensor_type.name in ("F32", "F16"):
            writer.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, (data, qtype) in replace.items():
        raw_dtype = None if qtype == GGMLQuantizationType.F32 else qtype
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def llama256(tmp_path_factory) -> Path:
    """A two-layer Llama whose input features are multiples of 256 (the K-quants' block)."""
    return build_llama256_checkpoint(tmp_path_factory.mktemp("kquants") / "llama256", 2, seed=3)


# The matrices a "Q4_K_M" file gives more bits (llama.cpp: the head, and attn_v / ffn_down in
# some layers; here in every layer).
_Q6_K_NAMES = {
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _mixed_q4_k_m(checkpoint: Path, out: Path) -> Path:
    """The checkpoint as Q4_K with the head, every attn_v and every ffn_down in Q6_K."""
    q4k = write_gguf(checkpoint, out.with_name("q4k-only.gguf"), "Q4_K")
    weights = load_file(checkpoint / "model.safetensors")
    layers = load_arch_config(checkpoint).num_hidden_layers
    replace = {}
    for gguf_name, hf in _Q6_K_NAMES.items():
        for i in range(layers) if "{i}" in gguf_name else [0]:
            w = weights[hf.format(i=i)].float().numpy()
            replace[gguf_name.format(i=i)] = (quantize_q6_k(w), GGMLQuantizationType.Q6_K)
    return rewrite_gguf(q4k, out, replace)


def _logits(path: Path, tokens: list[int], quantization: str | None = "auto") -> torch.Tensor:
    """[len, vocab] float32 logits of qiao's model of `path` on one prefill; `quantization`
    "auto" takes the file's own path, None keeps every layer float (the exact decode)."""
    arch = load_arch_config(path)
    kwargs = {} if quantization == "auto" else {"quantization": quantization}
    model = _load(path, arch, **kwargs)
    block_size, blocks = 16, -(-len(tokens) // 16)
    shape = (2, blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(arch.num_hidden_layers)])
    metadata = build_attn_metadata([len(tokens)], [len(tokens)], [list(range(blocks))], block_size)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), metadata.positions, metadata))


def _load(path: Path, arch, **kwargs) -> torch.nn.Module:
    if kwargs.get("quantization", "auto") is None:  # the decoded weights, every layer float
        from qiao.layers.linear import prepare_linears
        from qiao.models import gguf as gguf_module
        from qiao.models.registry import get_model_class

        with torch.device("meta"):
            model = get_model_class(arch)(arch)
        model = model.to_empty(device="cpu")
        model.tie_weights()
        model.load_weights(gguf_module.iter_gguf_weights(path))
        prepare_linears(model, quantization=None, batch_hint=8)
        return model
    return load_model(path, arch, dtype=torch.float32, device=torch.device("cpu"))


def _hf_logits(model_dir: Path, gguf_file: str | None = None) -> torch.Tensor:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **kwargs
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def _methods(path: Path) -> set[str]:
    model = _load(path, load_arch_config(path))
    return {m.method.name for m in model.modules() if isinstance(m, LinearBase)}


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got - expected).abs().max().item() / expected.abs().max().item()


def test_mixed_q4_k_q6_k_file_loads_on_int4_and_generates(llama256, tmp_path):
    """A "Q4_K_M"-style file: the exact decode equals transformers' reading of the same file.
    On the int4 path (Q6_K requantized onto int4) every layer is int4 and the logits are no
    further from the source than a file of Q4_K alone on the int4 path. (This random model is
    sensitive: 4-bit weights move its logits by half the largest one; docs/gguf.md has the
    measured figures.)"""
    path = _mixed_q4_k_m(llama256, tmp_path / "q4_k_m.gguf")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    assert types == {"Q4_K", "Q6_K"}
    assert gguf_quantization(path) == "int4"
    torch.testing.assert_close(
        _logits(path, PROMPT, None), _hf_logits(tmp_path, path.name), rtol=0, atol=1e-4
    )
    assert _methods(path) == {"int4"}
    source = _hf_logits(llama256)
    int4 = _logits(path, PROMPT)
    # Measured: 0.43 of the largest logit (its exact decode 0.39; Q4_K alone on int4 0.55).
    q4_k_only = _logits(tmp_path / "q4k-only.gguf", PROMPT)
    assert _relative_error(int4, source) <= _relative_error(q4_k_only, source)
    assert _relative_error(int4, _logits(path, PROMPT, None)) < 0.3  # measured 0.22
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8


def _encode(kind: str, w: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w in `kind`: the gguf package's encoder where it has one, else this test's."""
    own = {"Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
    raw = own[kind](w) if kind in own else quants.quantize(w, GGMLQuantizationType[kind])
    return raw, GGMLQuantizationType[kind]


# File -> the type of each matrix by its GGUF name ("Q5_K_M": Q5_K with llama.cpp's Q6_K ones).
_INT8_FILES = {
    "Q5_0": lambda name: "Q5_0",
    "Q6_K": lambda name: "Q6_K",
    "Q5_K_M": lambda name: (
        "Q6_K"
        if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight"))
        else "Q5_K"
    ),
}


@pytest.mark.parametrize("file_type", list(_INT8_FILES))
def test_q5_q6_file_runs_on_the_int8_path(file_type, llama256, tmp_path):
    """Every matrix but the embedding Q5_0, Q6_K, or Q5_K with Q6_K for the head, attn_v and
    ffn_down: decoded exactly (equal to transformers' reading of the file), then per-channel
    int8, close to the source."""
    f32 = write_gguf(llama256, tmp_path / "f32.gguf", "F32")
    replace = {}
    for t in gguf.GGUFReader(str(f32)).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            w = np.asarray(t.data).reshape(int(t.shape[1]), int(t.shape[0]))
            replace[t.name] = _encode(_INT8_FILES[file_type](t.name), w)
    path = rewrite_gguf(f32, tmp_path / f"{file_type}.gguf", replace)
    assert gguf_quantization(path) == "int8"
    decoded = _logits(path, PROMPT, None)
    torch.testing.assert_close(decoded, _hf_logits(tmp_path, path.name), rtol=0, atol=1e-4)
    assert _methods(path) == {"int8"}
    int8 = _logits(path, PROMPT)
    # Measured: int8 against the exact decode 0.045 (Q5_0), 0.051 (Q6_K), 0.038 (Q5_K_M) of
    # the largest logit; against the source 0.19, 0.12, 0.18 (the decode alone: 0.19, 0.097,
    # 0.21).
    assert _relative_error(int8, decoded) < 0.08
    bound = {"Q5_0": 0.25, "Q6_K": 0.15, "Q5_K_M": 0.25}[file_type]
    assert _relative_error(int8, _hf_logits(llama256)) < bound


# --- Llama 3.1 RoPE factors -------------------------------------------------------------------


def converter_rope_factors(config: dict) -> list[float]:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it for rope_type "llama3": per
    frequency 1 (wavelength under original / high_freq_factor), `factor` (over
    original / low_freq_factor), else 1 / ((1 - s) / factor + s) with
    s = (original / wavelength - low) / (high - low). Inverse frequencies in float32; the
    original length from the config's top level (8192 when absent), as the converter reads it."""
    scaling = config.get("rope_parameters") or config["rope_scaling"]  # transformers 5, 4
    theta = scaling.get("rope_theta", config.get("rope_theta", 10000.0))
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = config.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - s) / factor + s))
    return factors


# Llama 3.1's rope_scaling, its original length short enough (64) for a tiny model's
# frequencies to fall in all three bands.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def llama31(tmp_path_factory) -> Path:
    """A tiny Llama with Llama 3.1's rope_scaling, its original length short enough (64) that
    the three bands (kept, interpolated, slowed by `factor`) all hold frequencies."""
    path = tmp_path_factory.mktemp("llama31") / "llama31"
    tokenizer = _train_tokenizer(320)
    scaling = dict(LLAMA3_SCALING)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling=scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.original_max_position_embeddings = 64
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _randomize(model, seed=4)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _llama31_gguf(checkpoint: Path, out: Path) -> tuple[Path, list[float]]:
    config = json.loads((checkpoint / "config.json").read_text())
    factors = converter_rope_factors(config)
    f32 = write_gguf(checkpoint, out.with_name("no-rope-freqs.gguf"), "F32")
    data = np.asarray(factors, dtype=np.float32)
    return rewrite_gguf(f32, out, {"rope_freqs.weight": (data, GGMLQuantizationType.F32)}), factors


def test_llama31_rope_freqs_give_the_hf_checkpoints_logits_and_tokens(llama31, tmp_path):
    path, factors = _llama31_gguf(llama31, tmp_path / "llama31.gguf")
    assert 1.0 in factors and 8.0 in factors and any(1 < f < 8 for f in factors)
    arch = read_gguf_arch_config(path)
    assert arch.rope_scaling["rope_type"] == "freq_factors"
    assert arch.rope_scaling["freq_factors"] == pytest.approx(factors, rel=1e-6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama31, dtype=torch.float32).eval()
    tokens = (PROMPT * 6)[:90]  # past the original 64 positions
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0].float()
    got = _logits(path, tokens, None)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)
    # Without the factors (plain RoPE) the logits are far off: the test sees them.
    plain = _logits(path.with_name("no-rope-freqs.gguf"), tokens, None)
    assert (plain - expected).abs().max().item() > 100 * 2e-4
    out = hf.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    result = llm.generate([tokens], params, use_tqdm=False)[0].outputs[0].token_ids
    assert result == out[0, len(tokens) :].tolist()


def test_longrope_factors_stay_refused(tmp_path, llama31):
    from qiao.errors import ModelLoadError

    f32 = write_gguf(llama31, tmp_path / "f32.gguf", "F32")
    data = np.ones(8, np.float32)
    path = rewrite_gguf(
        f32,
        tmp_path / "longrope.gguf",
        {"rope_factors_long.weight": (data, GGMLQuantizationType.F32)},
    )
    with pytest.raises(ModelLoadError, match="LongRoPE factors"):
        read_gguf_arch_config(path)


def test_freq_factors_divide_the_inverse_frequencies():
    """Explicit factors reproduce transformers' llama3 inverse frequencies (to float32
    rounding); a list of the wrong length names the field."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qiao.errors import ConfigError
    from qiao.layers.rotary import compute_inv_freq

    scaling = dict(LLAMA3_SCALING)
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_theta=10000.0, rope_scaling=scaling
    )
    config.original_max_position_embeddings = 64
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    factors = converter_rope_factors(config.to_dict())
    got = compute_inv_freq(16, 10000.0, {"rope_type": "freq_factors", "freq_factors": factors})
    torch.testing.assert_close(got, expected.float(), rtol=3e-7, atol=0)
    with pytest.raises(ConfigError, match=r"rope_scaling\.freq_factors: 3 values, expected 8"):
        compute_inv_freq(16, 10000.0, {"rope_type": "freq_factors", "freq_factors": [1.0] * 3})


def _requantized(source: Path, out: Path, kind: str, embedding_kind: str | None = None) -> Path:
    """The F32 file `source` with every matrix encoded in `kind` by the gguf package, the
    embedding in `embedding_kind` (None: kept F32)."""
    replace = {}
    for t in gguf.GGUFReader(str(source)).tensors:
        chosen = embedding_kind if t.name == "token_embd.weight" else kind
        if len(t.shape) == 2 and chosen is not None:
            qtype = GGMLQuantizationType[chosen]
            w = np.asarray(t.data).reshape(int(t.shape[1]), int(t.shape[0]))
            replace[t.name] = (quants.quantize(w, qtype), qtype)
    return rewrite_gguf(source, out, replace)


def test_q4_1_file_runs_on_the_int4_path(llama256, tmp_path):
    """Q4_1's codes go onto int4 as they are: the exact decode equals transformers' reading,
    the int4 path adds only its kernels' rounding of the activations."""
    f32 = write_gguf(llama256, tmp_path / "f32.gguf", "F32")
    path = _requantized(f32, tmp_path / "q4_1.gguf", "Q4_1")
    assert gguf_quantization(path) == "int4"
    decoded = _logits(path, PROMPT, None)
    torch.testing.assert_close(decoded, _hf_logits(tmp_path, path.name), rtol=0, atol=1e-4)
    assert _methods(path) == {"int4"}
    assert _relative_error(_logits(path, PROMPT), decoded) < 0.05  # measured 0.018


def test_tied_head_of_a_wider_embedding_is_requantized_onto_int4(tiny_checkpoint, tmp_path):
    """Qwen3 ties its head to token_embd; in a Q4_0 file with a Q8_0 embedding (llama.cpp
    gives a tied embedding more bits) the head is the embedding requantized onto int4."""
    f32 = write_gguf(tiny_checkpoint("qwen3"), tmp_path / "f32.gguf", "F32")
    path = _requantized(f32, tmp_path / "mixed.gguf", "Q4_0", "Q8_0")
    arch = load_arch_config(path)
    assert arch.tie_word_embeddings
    model = _load(path, arch)
    assert model.lm_head.method.name == "int4"
    assert {m.method.name for m in model.modules() if isinstance(m, LinearBase)} == {"int4"}
    decoded = _logits(path, PROMPT, None)
    assert _relative_error(_logits(path, PROMPT), decoded) < 0.15  # measured 0.087
