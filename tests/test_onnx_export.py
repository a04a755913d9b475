"""`qiao export onnx` and the onnx backend: the exported graph against the PyTorch encoder,
the version folder it writes, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from qiao.cli import build_parser, main
from qiao.errors import ConfigError, ModelLoadError
from qiao.export.onnx import ExportError, export_onnx, verify_onnx
from qiao.models.bert import load_sentence_encoder
from qiao.runner.encoder import OnnxEncoder, OnnxEncoderMetadata, TorchEncoder, load_encoder

SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "Batching sentences of different lengths pads the short ones; the padding must not leak "
    "into any embedding.",
]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def minilm_export(minilm_dir: Path, tmp_path_factory) -> tuple[Path, int, str]:
    """MiniLM exported once through the command line: (version folder, exit code, stdout)."""
    out = tmp_path_factory.mktemp("repo") / "minilm" / "1"
    rc, stdout, _ = run_cli(["export", "onnx", "--model", str(minilm_dir), "--out", str(out)])
    return out, rc, stdout


@pytest.fixture(scope="module")
def minilm_torch(minilm_dir: Path) -> torch.nn.Module:
    return load_sentence_encoder(minilm_dir, dtype=torch.float32, device=torch.device("cpu"))


def test_cli_export_reports_the_check_and_writes_a_version_folder(minilm_export, minilm_dir):
    out, rc, stdout = minilm_export
    assert rc == 0
    assert "max abs diff" in stdout and str(out / "model.onnx") in stdout
    files = {p.name for p in out.iterdir()}
    assert {"model.onnx", "tokenizer.json", "config.json", "qiao_encoder.json"} <= files
    assert not any(p.name.startswith(".") for p in out.parent.iterdir())  # no staging left
    metadata = OnnxEncoderMetadata.read(out)
    assert (metadata.dim, metadata.max_length, metadata.normalize) == (384, 256, True)
    assert metadata.max_abs_diff <= 1e-4 and metadata.source == str(minilm_dir)
    assert f"{metadata.max_abs_diff:.3g}" in stdout
    # One self-contained file: no external-data tensors beside it.
    assert (out / "model.onnx").stat().st_size > 80e6


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 7), (4, 64), (9, 200), (3, 256)])
def test_exported_graph_matches_pytorch_on_dynamic_shapes(minilm_export, minilm_torch, batch, seq):
    out, _, _ = minilm_export
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    (ids_input, mask_input), (output,) = session.get_inputs(), session.get_outputs()
    assert (ids_input.name, mask_input.name, output.name) == (
        "input_ids",
        "attention_mask",
        "embedding",
    )
    assert all(isinstance(d, str) for d in ids_input.shape)  # both axes symbolic
    assert ids_input.type == mask_input.type == "tensor(int64)"
    assert output.type == "tensor(float)" and output.shape[1] == 384

    rng = np.random.default_rng(batch * 1000 + seq)
    lengths = rng.integers(1, seq + 1, size=batch)
    lengths[-1] = seq
    mask = (np.arange(seq) < lengths[:, None]).astype(np.int64)
    input_ids = rng.integers(0, 30522, size=(batch, seq), dtype=np.int64) * mask
    (got,) = session.run(None, {"input_ids": input_ids, "attention_mask": mask})
    with torch.inference_mode():
        want = minilm_torch(torch.from_numpy(input_ids), torch.from_numpy(mask)).numpy()
    assert got.shape == (batch, 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_onnx_encoder_serves_the_same_embeddings_as_torch(minilm_export, minilm_dir):
    out, _, _ = minilm_export
    onnx_encoder = load_encoder(out, "onnx", num_threads=1)
    torch_encoder = load_encoder(minilm_dir, "embedding")
    assert (onnx_encoder.dim, onnx_encoder.max_length) == (384, 256)
    texts = [*SENTENCES, "long " * 400]
    token_ids = onnx_encoder.tokenize(texts)
    assert token_ids == torch_encoder.tokenize(texts)
    got = onnx_encoder.embed(token_ids)
    np.testing.assert_allclose(got, torch_encoder.embed(token_ids), atol=1e-4, rtol=0)
    one_by_one = np.concatenate([onnx_encoder.embed([ids]) for ids in token_ids])
    np.testing.assert_allclose(one_by_one, got, atol=1e-5, rtol=0)


def test_onnx_encoder_rejects_bad_token_ids(minilm_export):
    out, _, _ = minilm_export
    encoder = OnnxEncoder(out)
    with pytest.raises(ConfigError, match="id 30522 is outside the vocabulary"):
        encoder.embed([[101, 30522, 102]])
    with pytest.raises(ConfigError, match="257 tokens exceed max_length 256"):
        encoder.embed([[101] * 257])
    with pytest.raises(ConfigError, match="empty batch"):
        encoder.embed([])


def _export_subparser() -> argparse.ArgumentParser:
    def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    return subparsers(subparsers(build_parser()).choices["export"]).choices["onnx"]


def test_cli_help_documents_every_flag():
    parser = _export_subparser()
    flags = {a.option_strings[-1]: a.help for a in parser._actions if a.option_strings}
    assert {"--model", "--out", "--opset", "--overwrite"} <= set(flags)
    assert all(help_text for help_text in flags.values())
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["export", "onnx", "--help"])
    assert exit_info.value.code == 0
    for flag, help_text in flags.items():
        assert flag in out.getvalue()
        assert help_text.split()[0] in out.getvalue()


def test_cli_refuses_a_non_empty_out_dir(minilm_dir: Path, tmp_path: Path):
    (tmp_path / "keep.txt").write_text("mine")
    rc, _, stderr = run_cli(["export", "onnx", "--model", str(minilm_dir), "--out", str(tmp_path)])
    assert rc == 2
    assert "is not empty" in stderr and "--overwrite" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_export_refuses_to_replace_the_checkpoint(tiny_bert_checkpoint):
    path = tiny_bert_checkpoint("bert-model")
    with pytest.raises(ConfigError, match="holds the checkpoint being exported"):
        export_onnx(path, path, overwrite=True)
    with pytest.raises(ConfigError, match="holds the checkpoint being exported"):
        export_onnx(path, path.parent, overwrite=True)
    assert (path / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def tiny_export(tiny_bert_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, version folder) of the tiny task-named BERT, exported at opset 18."""
    path = tiny_bert_checkpoint("bert-mlm")
    out = tmp_path_factory.mktemp("tiny-repo") / "tiny" / "1"
    (out / "stale").mkdir(parents=True)
    (out / "stale" / "old.onnx").write_text("an older export")
    report = export_onnx(path, out, opset=18, overwrite=True)
    assert report.out_dir == out and report.model_file == out / "model.onnx"
    assert report.opset == 18 and report.max_abs_diff <= report.atol == 1e-4
    assert {shape[0] for shape in report.checked_shapes} == {1, 3, 6}
    assert max(shape[1] for shape in report.checked_shapes) == 24
    return path, out


def test_export_api_overwrites_and_matches_torch(tiny_export):
    path, out = tiny_export
    assert not (out / "stale").exists()
    assert sorted(p.name for p in out.parent.iterdir()) == ["1"]
    onnx_encoder, torch_encoder = OnnxEncoder(out), TorchEncoder(path)
    assert OnnxEncoderMetadata.read(out).opset == 18
    assert (onnx_encoder.dim, onnx_encoder.max_length) == (32, 24)
    token_ids = torch_encoder.tokenize(SENTENCES)
    np.testing.assert_allclose(
        onnx_encoder.embed(token_ids), torch_encoder.embed(token_ids), atol=1e-5, rtol=0
    )


def test_verify_catches_a_graph_that_differs(tiny_export):
    path, out = tiny_export
    reference = load_sentence_encoder(path, dtype=torch.float32, device=torch.device("cpu"))
    cases = [(np.array([[2, 40, 41, 3]]), np.ones((1, 4), dtype=np.int64))]
    assert verify_onnx(out / "model.onnx", reference, cases, atol=1e-5) <= 1e-5
    perturbed = copy.deepcopy(reference)
    with torch.no_grad():
        perturbed.bert.encoder.layer[1].output.LayerNorm.bias.add_(0.01)
    with pytest.raises(ExportError, match=r"input shape \(1, 4\): max abs diff .* > atol 1e-05"):
        verify_onnx(out / "model.onnx", perturbed, cases, atol=1e-5)


def test_export_reports_an_unreachable_opset(tiny_bert_checkpoint, tmp_path: Path):
    out = tmp_path / "tiny" / "1"
    with pytest.raises(ExportError, match="could not convert the graph to opset 7"):
        export_onnx(tiny_bert_checkpoint("bert-model"), out, opset=7)
    assert not out.exists() and list((tmp_path / "tiny").iterdir()) == []


def test_onnx_folder_without_metadata_is_refused(tmp_path: Path):
    with pytest.raises(ModelLoadError, match=r"qiao_encoder\.json not found"):
        OnnxEncoder(tmp_path)
