"""BERT sentence encoders (qiao.models.bert, qiao.runner.encoder) against Hugging Face
transformers: the real all-MiniLM-L6-v2 and tiny random checkpoints of both naming schemes."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from qiao.errors import ConfigError, ModelLoadError
from qiao.runner.encoder import TorchEncoder, load_encoder

SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Embeddings turn sentences of very different lengths into vectors of one size, and "
    "padding a batch must not change any of them.",
    "",
]
HELLO_WORLD_PREFIX = [-0.034477, 0.031023, 0.006735, 0.026109, -0.039362]


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> TorchEncoder:
    return TorchEncoder(minilm_dir)


def hf_embeddings(model_dir: Path, token_ids: list[list[int]], normalize: bool) -> np.ndarray:
    """transformers `AutoModel` + mean pooling (+ L2 normalisation), one text at a time so the
    reference has no padding at all."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for ids in token_ids:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            rows.append(hidden.mean(dim=0))
    out = torch.stack(rows)
    if normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.numpy()


def test_minilm_tokenizer_matches_transformers(minilm: TorchEncoder, minilm_dir: Path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(minilm_dir)
    texts = [*SENTENCES, "many words " * 300]
    want = hf(texts, truncation=True, max_length=256)["input_ids"]
    got = minilm.tokenize(texts)
    assert got == want
    assert len(got[-1]) == minilm.max_length == 256 and got[-1][-1] == hf.sep_token_id


def test_minilm_matches_transformers_batched_and_one_by_one(minilm: TorchEncoder, minilm_dir: Path):
    token_ids = minilm.tokenize(SENTENCES)
    assert len({len(ids) for ids in token_ids}) == len(SENTENCES)  # all lengths differ
    want = hf_embeddings(minilm_dir, token_ids, normalize=True)
    batched = minilm.embed(token_ids)
    one_by_one = np.concatenate([minilm.embed([ids]) for ids in token_ids])
    assert batched.dtype == np.float32 and batched.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(batched, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(one_by_one, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-6)


def test_minilm_hello_world(minilm: TorchEncoder):
    assert minilm.dim == 384
    embedding = minilm.embed(minilm.tokenize(["hello world"]))[0]
    np.testing.assert_allclose(embedding[:5], HELLO_WORLD_PREFIX, atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", ["FP16", "BF16"])
def test_minilm_half_precisions_stay_close(minilm: TorchEncoder, minilm_dir: Path, precision):
    encoder = load_encoder(minilm_dir, "embedding", precision=precision)
    assert (
        encoder.model.bert.embeddings.word_embeddings.weight.dtype
        == {
            "FP16": torch.float16,
            "BF16": torch.bfloat16,
        }[precision]
    )
    token_ids = minilm.tokenize(SENTENCES)
    got, want = encoder.embed(token_ids), minilm.embed(token_ids)
    assert got.dtype == np.float32
    cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1)
    assert cosine.min() > 0.999
    assert np.abs(got - want).max() > 0  # it really ran in the lower precision


@pytest.mark.parametrize("variant", ["bert-model", "bert-mlm"])
def test_tiny_bert_matches_transformers(tiny_bert_checkpoint, variant: str):
    path = tiny_bert_checkpoint(variant)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    is_task_checkpoint = variant == "bert-mlm"
    assert all(n.startswith(("bert.", "cls.")) for n in names) == is_task_checkpoint
    encoder = TorchEncoder(path)
    assert encoder.dim == 32
    # bert-mlm's sentence_bert_config.json caps the 40 positions at 24.
    assert encoder.max_length == (24 if is_task_checkpoint else 40)
    token_ids = encoder.tokenize(SENTENCES)
    assert token_ids[0][0] == 2 and token_ids[0][-1] == 3  # [CLS] ... [SEP]
    want = hf_embeddings(path, token_ids, normalize=is_task_checkpoint)
    got = encoder.embed(token_ids)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    one_by_one = np.concatenate([encoder.embed([ids]) for ids in token_ids])
    np.testing.assert_allclose(one_by_one, got, atol=1e-5, rtol=0)
    norms = np.linalg.norm(got, axis=1)
    if is_task_checkpoint:
        np.testing.assert_allclose(norms, 1.0, atol=1e-6)
    else:
        assert np.abs(norms - 1.0).min() > 0.1  # no Normalize module: raw mean pooling


def test_tokenize_truncates_to_max_length(tiny_bert_checkpoint):
    encoder = TorchEncoder(tiny_bert_checkpoint("bert-mlm"))
    (ids,) = encoder.tokenize(["the cat sat on the mat " * 20])
    assert len(ids) == encoder.max_length == 24
    assert ids[0] == 2 and ids[-1] == 3
    assert encoder.embed([ids]).shape == (1, 32)


def test_lowering_max_length_truncates_and_limits(tiny_bert_checkpoint):
    encoder = TorchEncoder(tiny_bert_checkpoint("bert-model"))
    encoder.max_length = 10
    (ids,) = encoder.tokenize(["the cat sat on the mat " * 20])
    assert len(ids) == 10 and ids[-1] == 3
    with pytest.raises(ConfigError, match="11 tokens exceed max_length 10"):
        encoder.embed([[2] * 11])
    with pytest.raises(ConfigError, match=r"max_sequence_length: must be in \[1, 40\]"):
        encoder.max_length = 41
    assert encoder.max_length == 10


def test_embed_accepts_numpy_rows_and_runs_on_worker_threads(tiny_bert_checkpoint):
    encoder = TorchEncoder(tiny_bert_checkpoint("bert-model"))
    token_ids = encoder.tokenize(SENTENCES)
    want = encoder.embed(token_ids)
    np.testing.assert_array_equal(encoder.embed([np.array(r, np.int32) for r in token_ids]), want)
    batches = [token_ids[i:] for i in range(len(token_ids))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(encoder.embed, batches))
    for start, result in enumerate(results):
        np.testing.assert_allclose(result, want[start:], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([], "empty batch"),
        ([[2, 3], []], r"token_ids\[1\]: expected a non-empty"),
        ([[2, 10_000, 3]], r"id 10000 is outside the vocabulary \[0, "),
        ([[2, -1, 3]], "id -1 is outside the vocabulary"),
        ([[2] * 41], r"token_ids\[0\]: 41 tokens exceed max_length 40"),
        ([[2.0, 3.0]], "must be integers"),
        ([[[2, 3]]], "expected a non-empty list of token ids"),
    ],
)
def test_embed_rejects_bad_token_ids(tiny_bert_checkpoint, token_ids, message):
    encoder = TorchEncoder(tiny_bert_checkpoint("bert-model"))
    with pytest.raises(ConfigError, match=message):
        encoder.embed(token_ids)


def test_tokenize_rejects_non_strings(tiny_bert_checkpoint):
    encoder = TorchEncoder(tiny_bert_checkpoint("bert-model"))
    with pytest.raises(ConfigError, match="got one string"):
        encoder.tokenize("hello world")
    with pytest.raises(ConfigError, match=r"texts\[1\]: expected a string, got int"):
        encoder.tokenize(["hello", 3])
    assert encoder.tokenize([]) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(backend="llm"), "backend: 'llm' is not an encoder backend"),
        (dict(backend="embedding", precision="INT4"), "precision_mode: unsupported value"),
        (dict(backend="onnx", precision="FP16"), "onnx backend runs the exported FP32"),
        (dict(backend="embedding", device="tpu"), "device: 'tpu'"),
    ],
)
def test_load_encoder_rejects_bad_settings(tiny_bert_checkpoint, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_encoder(tiny_bert_checkpoint("bert-model"), **kwargs)


def test_torch_encoder_rejects_bad_dtype(tiny_bert_checkpoint):
    with pytest.raises(ConfigError, match="dtype: unsupported value 'int8'"):
        TorchEncoder(tiny_bert_checkpoint("bert-model"), dtype="int8")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_pooling_is_refused(tiny_bert_checkpoint, tmp_path: Path):
    path = _copy(tiny_bert_checkpoint("bert-mlm"), tmp_path / "cls-pooling")
    pooling = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ModelLoadError, match="pooling_mode_cls_token unsupported"):
        TorchEncoder(path)


def test_incomplete_checkpoint_is_refused(tiny_bert_checkpoint, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_bert_checkpoint("bert-model"), tmp_path / "incomplete")
    tensors = load_file(path / "model.safetensors")
    del tensors["encoder.layer.1.output.dense.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks tensor\(s\): encoder.layer.1.output.dense"):
        TorchEncoder(path)


def test_missing_tokenizer_is_refused(tiny_bert_checkpoint, tmp_path: Path):
    path = _copy(tiny_bert_checkpoint("bert-model"), tmp_path / "no-tokenizer")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json not found"):
        TorchEncoder(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("precision", "atol"), [("FP32", 1e-4), ("FP16", 5e-3), ("BF16", 2e-2)])
def test_minilm_on_cuda_matches_cpu(minilm: TorchEncoder, minilm_dir: Path, precision, atol):
    encoder = load_encoder(minilm_dir, "embedding", precision=precision, device="cuda")
    token_ids = minilm.tokenize(SENTENCES)
    got = encoder.embed(token_ids)
    assert got.dtype == np.float32 and got.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(got, minilm.embed(token_ids), atol=atol, rtol=0)
