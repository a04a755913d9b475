"""GGUF checkpoints: files written from tiny random checkpoints the way llama.cpp's converter
lays them out (qiao.bench.gguf.write_gguf; the layout checked against transformers' own GGUF
reader), read back by qiao.models.gguf.

References: the source checkpoint through qiao and transformers (F32 greedy tokens), the source's
logits (F16 / BF16), transformers' GGUF loader, which dequantizes and unpermutes on its own (Q8_0 /
Q4_0 / Q4_K), gguf.quants.dequantize (the block decoders), the source tokenizer, and the real
llama.cpp-made stories260K.gguf with its reference continuation.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import (
    STORIES_DIR,
    build_attn_metadata,
    build_llama256_checkpoint,
)
from gguf import GGMLQuantizationType, GGUFWriter, quants

from qiao.bench.gguf import quantize_q4_k, write_gguf
from qiao.entrypoints.llm import LLM
from qiao.errors import ModelLoadError
from qiao.layers.linear import LinearBase
from qiao.models import load_arch_config, load_model
from qiao.models.gguf import gguf_int4_weights, read_gguf_arch_config
from qiao.models.gguf_quants import decode_q4_0, decode_q4_k, decode_q8_0
from qiao.sampling_params import SamplingParams
from qiao.tokenizer import load_tokenizer

STORIES_GGUF = STORIES_DIR.parent / "stories260K" / "stories260K.gguf"
PROMPT = [1, 5, 9, 33, 77, 120, 4, 200]


@pytest.fixture(scope="module")
def gguf_of(tiny_checkpoint, tmp_path_factory):
    """gguf_of(arch, file_type) -> a .gguf file of tiny_checkpoint(arch), written once."""
    made: dict[tuple[str, str], Path] = {}
    folder = tmp_path_factory.mktemp("gguf")

    def get(arch: str, file_type: str = "F32") -> Path:
        if (arch, file_type) not in made:
            path = folder / f"{arch}-{file_type}" / "tiny.gguf"
            path.parent.mkdir()
            made[arch, file_type] = write_gguf(tiny_checkpoint(arch), path, file_type)
        return made[arch, file_type]

    return get


@pytest.fixture(scope="module")
def q4k_checkpoint(tmp_path_factory) -> Path:
    """A one-layer Llama whose input features are multiples of 256 (Q4_K's super-block)."""
    return build_llama256_checkpoint(tmp_path_factory.mktemp("q4k") / "llama256", 1, seed=0)


def qiao_logits(path: Path, tokens: list[int], **kwargs) -> torch.Tensor:
    """[len, vocab] float32 logits of qiao's model of `path` on one prefill of `tokens`."""
    arch = load_arch_config(path)
    model = load_model(path, arch, dtype=torch.float32, device=torch.device("cpu"), **kwargs)
    block_size, blocks = 16, -(-len(tokens) // 16)
    shape = (2, blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(arch.num_hidden_layers)])
    metadata = build_attn_metadata([len(tokens)], [len(tokens)], [list(range(blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), metadata.positions, metadata)
        return model.compute_logits(hidden)


def hf_gguf_model(path: Path) -> torch.nn.Module:
    """transformers' own reading of the file (its dequantization and q/k unpermutation)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def greedy(model: str | Path, tokens: list[int], n: int = 12) -> list[int]:
    llm = LLM(model=str(model), dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return llm.generate([tokens], params, use_tqdm=False)[0].outputs[0].token_ids


# --- block decoders ---------------------------------------------------------------------------


def _f16_bytes(value: float, count: int) -> np.ndarray:
    return np.full(count, value, np.float16).view(np.uint8).reshape(count, 2)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K"])
def test_block_decoders_equal_gguf_dequantize(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 512)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize_q4_k(w) if kind == "Q4_K" else quants.quantize(w, qtype)
    if kind == "Q4_K":  # every bit pattern of the packed 6-bit scales and mins, not just ours
        raw = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        for block in range(raw.shape[1] // 144):
            raw[:, block * 144 : block * 144 + 2] = _f16_bytes(0.01 * (block + 1), 6)
            raw[:, block * 144 + 2 : block * 144 + 4] = _f16_bytes(0.003, 6)
    expected = quants.dequantize(raw, qtype)
    if kind == "Q8_0":
        got = decode_q8_0(torch.from_numpy(raw))
    else:
        codes, scales, offsets = (decode_q4_0 if kind == "Q4_0" else decode_q4_k)(
            torch.from_numpy(raw)
        )
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        got = codes.float().reshape(6, -1, 32) * scales[..., None] - offsets[..., None]
    assert np.array_equal(got.reshape(expected.shape).numpy(), expected)


# --- the file layout --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_layout_is_what_transformers_reads(arch, gguf_of, tiny_checkpoint):
    """transformers' GGUF reader (its own q/k unpermutation) gets the source weights back."""
    source = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint(arch), dtype=torch.float32
    ).state_dict()
    read = hf_gguf_model(gguf_of(arch)).state_dict()
    assert set(source) <= set(read)
    for name, tensor in source.items():
        assert torch.equal(read[name], tensor), name


def test_arch_config_from_metadata(gguf_of, tiny_checkpoint):
    for arch in ("llama", "qwen2", "qwen3", "mistral", "phi3", "qwen2moe", "qwen3moe"):
        expected = load_arch_config(tiny_checkpoint(arch))
        got = read_gguf_arch_config(gguf_of(arch))
        for field in (
            "architecture",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rotary_dim",
            "rope_theta",
            "tie_word_embeddings",
            "attention_bias",
            "qk_norm",
            "sliding_window",
            "bos_token_id",
            "eos_token_ids",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
        ):
            # (Mistral is llama.cpp's llama arch; its sliding window makes it Mistral again.)
            assert getattr(got, field) == getattr(expected, field), (arch, field)
        assert got.rms_norm_eps == pytest.approx(expected.rms_norm_eps)


# --- numerics per format ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch", ["llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2moe", "qwen3moe"]
)
def test_f32_greedy_equals_source_checkpoint_and_transformers(arch, gguf_of, tiny_checkpoint):
    source = tiny_checkpoint(arch)
    from_gguf = greedy(gguf_of(arch), PROMPT)
    assert from_gguf == greedy(source, PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert from_gguf == out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_logits_equal_source(arch, gguf_of, tiny_checkpoint):
    expected = qiao_logits(tiny_checkpoint(arch), PROMPT)
    torch.testing.assert_close(qiao_logits(gguf_of(arch), PROMPT), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("file_type", ["F16", "BF16"])
def test_half_precision_logits_close_to_source(file_type, gguf_of, tiny_checkpoint):
    """Weights rounded to 16 bits, computed in float32: close to the float32 source."""
    expected = qiao_logits(tiny_checkpoint("llama"), PROMPT)
    got = qiao_logits(gguf_of("llama", file_type), PROMPT)
    tolerance = {"F16": 5e-3, "BF16": 3e-2}[file_type]
    assert (got - expected).abs().max().item() < tolerance * expected.abs().max().item()


def test_q8_0_mixture_of_experts_runs_on_the_int8_path(gguf_of, tiny_checkpoint):
    """Qwen3-MoE in Q8_0: experts and linears int8; greedy close to the float source."""
    path = gguf_of("qwen3moe", "Q8_0")
    expected = qiao_logits(tiny_checkpoint("qwen3moe"), PROMPT)
    got = qiao_logits(path, PROMPT)
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def _reference_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return hf_gguf_model(path)(torch.tensor([PROMPT])).logits[0].float()


def test_q8_0_on_the_int8_path_close_to_the_dequantized_model(gguf_of):
    """Q8_0 decoded exactly equals transformers' float model of the dequantized weights; on
    qiao's int8 path (the file's own: per-channel requantization, one more rounding) close."""
    path = gguf_of("llama", "Q8_0")
    expected = _reference_logits(path)
    torch.testing.assert_close(_dequantized_float_logits(path), expected, rtol=0, atol=1e-4)
    int8 = qiao_logits(path, PROMPT)
    assert (int8 - expected).abs().max().item() < 0.03 * expected.abs().max().item()
    assert (int8.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.75


def _dequantized_float_logits(path: Path) -> torch.Tensor:
    """qiao's model of the file with the float weights it decoded, no int8 step."""
    from qiao.models import gguf as gguf_module

    arch = read_gguf_arch_config(path)
    with torch.device("meta"):
        from qiao.models.registry import get_model_class

        model = get_model_class(arch)(arch)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    model.load_weights(gguf_module.iter_gguf_weights(path))
    from qiao.layers.linear import prepare_linears

    prepare_linears(model, quantization=None, batch_hint=8)
    block_size, blocks = 16, -(-len(PROMPT) // 16)
    shape = (2, blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    model.bind_kv_caches([torch.zeros(shape) for _ in range(arch.num_hidden_layers)])
    metadata = build_attn_metadata([len(PROMPT)], [len(PROMPT)], [list(range(blocks))], block_size)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(PROMPT), metadata.positions, metadata))


@pytest.mark.parametrize("file_type", ["Q4_0", "Q4_K"])
def test_q4_logits_equal_the_dequantized_model(file_type, gguf_of, q4k_checkpoint, tmp_path):
    if file_type == "Q4_K":
        path = write_gguf(q4k_checkpoint, tmp_path / "q4k.gguf", "Q4_K")
    else:
        path = gguf_of("llama", "Q4_0")
    expected = _reference_logits(path)
    torch.testing.assert_close(_dequantized_float_logits(path), expected, rtol=0, atol=1e-4)
    # The 4-bit form the int4 path takes: codes 0..15 and a scale and offset per 32 weights.
    for name, w in gguf_int4_weights(path):
        assert w.group_size == 32 and w.codes.dtype == torch.uint8 and w.codes.max() <= 15, name
    arch = load_arch_config(path)
    model = load_model(path, arch, dtype=torch.float32, device=torch.device("cpu"))
    methods = {m.method.name for m in model.modules() if isinstance(m, LinearBase)}
    got = qiao_logits(path, PROMPT)  # the file's own path: int4
    assert methods == {"int4"}
    # The int4 kernels' own rounding of the activations on top of the exact weights.
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_q4_0_tied_head_reads_the_embedding_codes(gguf_of):
    """Qwen3 ties its head to token_embd: on the int4 path the head takes the embedding's
    Q4_0 codes (the embedding itself stays float)."""
    path = gguf_of("qwen3", "Q4_0")
    expected = _dequantized_float_logits(path)
    model = load_model(
        path, load_arch_config(path), dtype=torch.float32, device=torch.device("cpu")
    )
    got = qiao_logits(path, PROMPT)
    assert model.lm_head.method.name == "int4"
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()


# --- tokenizer and chat -----------------------------------------------------------------------


TEXTS = ["Once upon a time there was a fox.", "x = y + z; print('hello, world!')", "  two  spaces"]


def test_tokenizer_encodes_and_decodes_like_the_source(gguf_of, tiny_checkpoint):
    for arch in ("llama", "qwen2"):
        source = load_tokenizer(tiny_checkpoint(arch))
        got = load_tokenizer(gguf_of(arch))
        assert (got.bos_token_id, got.eos_token_id) == (source.bos_token_id, source.eos_token_id)
        for text in TEXTS:
            ids = source.encode(text)
            assert got.encode(text) == ids
            assert got.decode(ids) == source.decode(ids)


def test_chat_uses_the_template_from_the_metadata(gguf_of, tiny_checkpoint):
    messages = [{"role": "user", "content": "Hello there"}]
    source = load_tokenizer(tiny_checkpoint("llama"))
    llm = LLM(model=str(gguf_of("llama")), dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.chat_template == source.chat_template
    expected = source.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        expected
    )
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert out.prompt_token_ids == source.encode(expected, add_special_tokens=False)


# --- the real llama.cpp file ------------------------------------------------------------------

STORIES_CONTINUATION = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267]


@pytest.mark.skipif(not STORIES_GGUF.is_file(), reason=f"{STORIES_GGUF} not present")
def test_stories260k_gguf_made_by_llama_cpp(tmp_path):
    """llama.cpp's own file (SentencePiece vocabulary, permuted q/k): the reference
    continuation (shared/models/stories260K/REFERENCE.md) and the HF copy's tokenizer."""
    folder = tmp_path / "stories"
    folder.mkdir()
    shutil.copy(STORIES_GGUF, folder / STORIES_GGUF.name)
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=15, temperature=0.0)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 403, 407, 261, 378]
    assert out.outputs[0].token_ids == STORIES_CONTINUATION
    assert out.outputs[0].text == ", there was a little girl named Lily. She loved to"
    hf = load_tokenizer(STORIES_DIR)
    for text in TEXTS + ["Lily's café"]:
        assert llm.get_tokenizer().encode(text) == hf.encode(text)


# --- errors -----------------------------------------------------------------------------------


def _write(path: Path, arch: str, tensors: dict[str, tuple]) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, args in tensors.items():
        writer.add_tensor(name, *args)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    path = _write(tmp_path / "m.gguf", "gpt2", {"x": (np.zeros(4, np.float32),)})
    with pytest.raises(ModelLoadError, match=r"architecture 'gpt2' is not supported.*llama"):
        load_arch_config(path)


def test_unsupported_quant_type_names_it_and_the_supported_ones(gguf_of, tmp_path):
    """A Q3_K matrix: the error names the tensor, Q3_K and the types qiao reads."""
    import gguf

    source = gguf.GGUFReader(str(gguf_of("llama")))
    writer = GGUFWriter(str(tmp_path / "q3k.gguf"), "llama")
    for key, field in source.fields.items():
        if key.startswith("llama."):
            writer.add_key_value(key, field.contents(), field.types[0])
    for t in source.tensors:
        if t.name == "blk.0.ffn_down.weight":  # as Q3_K blocks: 256 weights in 110 bytes
            raw = np.zeros((int(t.shape[1]), 110), np.uint8)
            writer.add_tensor(t.name, raw, raw_dtype=GGMLQuantizationType.Q3_K)
        else:
            writer.add_tensor(t.name, np.asarray(t.data).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = load_arch_config(tmp_path / "q3k.gguf")
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight.*Q3_K.*F32, F16, BF16"):
        load_model(tmp_path / "q3k.gguf", arch, dtype=torch.float32, device=torch.device("cpu"))


def test_folder_with_two_gguf_files_asks_for_one(gguf_of, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(gguf_of("llama"), tmp_path / name)
    with pytest.raises(
        ModelLoadError, match=r"exactly one \.gguf file \(found: a\.gguf, b\.gguf\)"
    ):
        load_arch_config(tmp_path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_arch_config(path)


# --- the benchmark's plumbing (no speed is asserted) ------------------------------------------


def test_bench_gguf_reports_both_engines_or_how_to_install(gguf_of):
    from qiao.bench.gguf import GGUFBenchConfig, format_gguf_bench, run_gguf_bench

    cfg = GGUFBenchConfig(
        gguf=str(gguf_of("llama")), prompt_len=8, output_len=4, batch=2, repeats=1, threads=1
    )
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        installed = False
    else:
        installed = True
    report = run_gguf_bench(cfg)
    qiao = report["results"]["qiao"]
    assert len(qiao["greedy_tokens"]) == 4 and qiao["batch1_decode_tok_s"] > 0
    assert qiao["greedy_tokens"] == greedy(gguf_of("llama"), _bench_prompt(report), n=4)
    llamacpp = report["results"]["llama.cpp"]
    if installed:
        assert len(llamacpp["greedy_tokens"]) == 4
    else:
        assert "qiao[llamacpp]" in llamacpp["skipped"]
    assert "b1 decode tok/s" in format_gguf_bench(report)


def _bench_prompt(report: dict) -> list[int]:
    """The benchmark's first prompt (its seeded generator, as it draws them)."""
    rng = np.random.default_rng(0)
    return rng.integers(16, 320, report["config"]["prompt_len"]).tolist()


@pytest.mark.skipif(not STORIES_DIR.is_dir(), reason=f"{STORIES_DIR} not present")
def test_write_gguf_is_what_llama_cpp_reads(tmp_path):
    """stories260K's Hugging Face copy through write_gguf: llama.cpp itself (when installed)
    and qiao both continue the prompt as the reference does (REFERENCE.md)."""
    # (Its SentencePiece vocabulary goes in as byte-level BPE, which only llama.cpp's token
    # ids survive: qiao runs on ids here.)
    path = write_gguf(STORIES_DIR, tmp_path / "stories.gguf", "F32")
    prompt = [1, 403, 407, 261, 378]
    qiao = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=15, temperature=0.0)
    out = qiao.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == STORIES_CONTINUATION
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python: pip install qiao[llamacpp]"
    )
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    out = []
    for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == len(STORIES_CONTINUATION):
            break
    assert out == STORIES_CONTINUATION
