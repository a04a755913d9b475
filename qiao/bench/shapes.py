"""Built-in model shapes: published `config.json`s of real models, for weight-free benchmarks.

`write_shape_dir(name, dir)` writes one as `config.json` so that
`LLM(dir, load_format="dummy", skip_tokenizer_init=True)` builds the real architecture with random
weights: speed depends on shapes, not on weight values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Numbers from each model's published config.json on the Hugging Face Hub.
SHAPES: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.041666666666666664,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen2.5-0.5B (q/k/v carry a bias; Qwen2 configs do not say so)
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    # Not a real model: small enough for tests. Untied, so the lm_head load path is exercised,
    # and a wide init so greedy tokens vary (HF's default 0.02 makes them repeat).
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.2,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}


def shape_names() -> list[str]:
    return list(SHAPES)


def shape_config(name: str) -> dict[str, Any]:
    """A copy of the named shape's config.json dict; ValueError names the known shapes."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return json.loads(json.dumps(SHAPES[name]))


def write_shape_dir(name: str, directory: str | Path) -> Path:
    """Write the named shape's config.json (and nothing else) into `directory`; return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(shape_config(name), indent=2))
    return directory


def write_word_tokenizer(directory: str | Path, words: list[str]) -> None:
    """A word-level tokenizer over the shape's whole vocabulary in `directory`: `words` first
    (one token each), then filler words. Random weights emit ids across the vocabulary; a
    smaller tokenizer would decode most of them to nothing, and a server would stream several
    tokens per chunk, hiding the per-token latency being measured."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = Path(directory)
    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    vocab = ["<unk>", *dict.fromkeys(words)]
    vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
