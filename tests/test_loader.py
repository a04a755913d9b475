"""Checkpoint loading: formats, the architecture config, and every refusal naming its cause."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qiao.errors import ConfigError, ModelLoadError
from qiao.hal import resolve_dtype
from qiao.models import find_weight_files, load_arch_config, load_model
from qiao.models.arch_config import ArchConfig

CPU = torch.device("cpu")


@pytest.fixture
def llama_copy(tiny_checkpoint, tmp_path) -> Path:
    """A writable copy of the tiny llama checkpoint."""
    return Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama"))


def _load(model_dir: Path, **kwargs) -> torch.nn.Module:
    kwargs = {"dtype": torch.float32, "device": CPU, **kwargs}
    return load_model(model_dir, load_arch_config(model_dir), **kwargs)


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_sharded_index_loads_like_single_file(llama_copy):
    single = _load(llama_copy).state_dict()
    tensors = load_file(llama_copy / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, llama_copy / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (llama_copy / "model.safetensors").unlink()

    assert [p.name for p in find_weight_files(llama_copy)] == sorted(shards)
    sharded = _load(llama_copy).state_dict()
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name


def test_missing_shard_is_named(llama_copy):
    weight_map = {"model.norm.weight": "model-00002-of-00002.safetensors"}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        _load(llama_copy)


def test_dummy_needs_no_weights_and_is_deterministic(tiny_checkpoint):
    arch = load_arch_config(tiny_checkpoint("qwen3"))
    first = load_model(None, arch, dtype=torch.float32, device=CPU, load_format="dummy")
    second = load_model(None, arch, dtype=torch.float32, device=CPU, load_format="dummy")
    assert not first.training
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
        assert a.abs().max() <= (1.1 if name.endswith("norm.weight") else 0.01), name


def test_pickle_only_checkpoint_is_refused(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    (llama_copy / "pytorch_model.bin").write_bytes(b"not unpickled, ever")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*refused.*safetensors"):
        _load(llama_copy)


def test_no_weights_names_the_expected_file(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        _load(llama_copy)


def test_missing_config_and_dir_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "config.json"))):
        load_arch_config(tmp_path)
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "absent"))):
        load_arch_config(tmp_path / "absent")


def test_unknown_architecture_is_named(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match=r"architectures.*'GPT2LMHeadModel'.*LlamaForCausalLM"):
        load_arch_config(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    _rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        _load(llama_copy)


def test_unexpected_or_misshapen_tensor_is_named(llama_copy):
    _rewrite_weights(llama_copy, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(2)}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.extra\.weight"):
        _load(llama_copy)
    _rewrite_weights(llama_copy, lambda t: t.pop("model.layers.0.extra.weight"))
    _rewrite_weights(llama_copy, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(3,\)"):
        _load(llama_copy)


@pytest.mark.parametrize(
    "remote", [{"auto_map": {"AutoModel": "x.Y"}}, {"trust_remote_code": True}]
)
def test_remote_code_is_refused(llama_copy, remote):
    _edit_config(llama_copy, **remote)
    with pytest.raises(ModelLoadError, match="remote code"):
        load_arch_config(llama_copy)


def test_bfloat16_load(tiny_checkpoint):
    model = _load(tiny_checkpoint("qwen2"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_bad_dtype_and_load_format_are_named(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"dtype.*'float8'.*bfloat16"):
        resolve_dtype("float8", None)
    assert resolve_dtype("auto", None) is torch.float32
    with pytest.raises(ConfigError, match=r"load_format.*'pickle'"):
        _load(tiny_checkpoint("llama"), load_format="pickle")


def test_auto_dtype_takes_the_cpus_fast_path_for_half_precision_checkpoints():
    """On the CPU a bfloat16 or float16 checkpoint runs in bfloat16 where the CPU multiplies it
    natively (torch's own CPU feature probe says so), else in float32; float32 stays float32;
    on CUDA the checkpoint's dtype is kept."""
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    fast_half = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", "bfloat16", "cpu") is fast_half
    assert resolve_dtype("auto", "torch.float16", "cpu") is fast_half
    assert resolve_dtype("auto", "float32", "cpu") is torch.float32
    assert resolve_dtype("auto", "float16", "cuda") is torch.float16
    assert resolve_dtype("auto", "bfloat16", "cuda") is torch.bfloat16
    # An explicit dtype is never changed.
    assert resolve_dtype("float16", "bfloat16", "cpu") is torch.float16


BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_arch_config_reads_transformers4_keys():
    arch = ArchConfig.from_dict(
        {
            **BASE,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "torch_dtype": "bfloat16",
            "eos_token_id": [5, 6],
        }
    )
    assert arch.rope_theta == 500000.0
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert arch.torch_dtype == "bfloat16"
    assert arch.eos_token_ids == (5, 6)
    assert (arch.head_dim, arch.num_key_value_heads) == (16, 4)


def test_arch_config_reads_transformers5_keys():
    arch = ArchConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen2ForCausalLM"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "dtype": "float16",
            "eos_token_id": 7,
            "sliding_window": 32,
            "use_sliding_window": False,
        }
    )
    assert (arch.rope_theta, arch.rope_scaling, arch.torch_dtype) == (1e6, None, "float16")
    assert arch.eos_token_ids == (7,)
    assert arch.attention_bias and not arch.qk_norm
    assert arch.sliding_window is None


def test_arch_config_sliding_window_rules():
    mistral = ArchConfig.from_dict(
        {**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 8}
    )
    assert mistral.sliding_window == 8
    qwen = {
        **BASE,
        "architectures": ["Qwen3ForCausalLM"],
        "sliding_window": 8,
        "use_sliding_window": True,
    }
    assert ArchConfig.from_dict({**qwen, "max_window_layers": 0}).sliding_window == 8
    assert ArchConfig.from_dict({**qwen, "max_window_layers": 2}).sliding_window is None
    with pytest.raises(ConfigError, match="layer_types"):
        ArchConfig.from_dict({**qwen, "max_window_layers": 1})
