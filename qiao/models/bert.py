"""BERT-family sentence encoders: the BERT encoder, the sentence-transformers head over it (mean
pooling, optional L2 normalisation), their configs, and loading them from a checkpoint.

Post-LN layers: embeddings (word + position + token type) -> LayerNorm, then per layer
`x = LN(x + Attn(x))`, `x = LN(x + MLP(x))`. Parameter names follow Hugging Face's `BertModel`;
checkpoints of a task model (`BertForMaskedLM`, ...) name them under `bert.`, which is stripped.
The pooler and task heads are not needed for sentence embeddings and are not loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qiao.errors import ModelLoadError
from qiao.models.loader import find_weight_files, iter_safetensors

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_new": partial(nn.GELU, approximate="tanh"),
    "gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"),
    "relu": nn.ReLU,
}
# Checkpoint tensors an encoder does not use: the pooler, task heads, a non-persistent buffer.
_UNUSED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.", "embeddings.position_ids")
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a BERT `config.json` the encoder reads."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """How token states become one sentence vector (sentence-transformers' modules).

    Without modules.json (a bare Hugging Face checkpoint): mean pooling, no normalisation, and
    the model's whole position range."""

    normalize: bool
    max_seq_length: int | None  # sentence_bert_config.json's limit, when given


def load_bert_config(model_dir: Path) -> BertConfig:
    """The encoder config of the checkpoint in `model_dir` (its config.json)."""
    raw = _read_json(model_dir / "config.json")
    if raw.get("model_type") not in (None, "bert"):
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: model_type {raw['model_type']!r} is not a BERT encoder"
        )
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: position_embedding_type "
            f"{raw['position_embedding_type']!r} unsupported; only 'absolute'"
        )
    hidden_act = raw.get("hidden_act", "gelu")
    if hidden_act not in _ACTIVATIONS:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: hidden_act {hidden_act!r} unsupported; "
            f"supported: {', '.join(_ACTIVATIONS)}"
        )
    try:
        config = BertConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=hidden_act,
        )
    except KeyError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: missing key {e.args[0]!r}") from None
    if config.hidden_size % config.num_attention_heads:
        raise ModelLoadError(
            f"{model_dir / 'config.json'}: hidden_size {config.hidden_size} is not a multiple "
            f"of num_attention_heads {config.num_attention_heads}"
        )
    return config


def load_pooling_config(model_dir: Path) -> PoolingConfig:
    """sentence-transformers' pooling, normalisation and length limit for `model_dir`.

    Only mean pooling is supported; a checkpoint asking for another mode is refused rather than
    served with the wrong vectors."""
    modules_file = model_dir / "modules.json"
    modules = _read_json(modules_file) if modules_file.is_file() else []
    normalize = any(m.get("type") == _NORMALIZE_MODULE for m in modules)
    for module in modules:
        if module.get("type") == "sentence_transformers.models.Pooling":
            _check_mean_pooling(model_dir / module.get("path", "") / "config.json")
    st_config = model_dir / "sentence_bert_config.json"
    max_seq_length = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    return PoolingConfig(normalize, None if max_seq_length is None else int(max_seq_length))


def max_sequence_length(config: BertConfig, pooling: PoolingConfig) -> int:
    """Longest token sequence the encoder accepts: the position table, capped by
    sentence-transformers' `max_seq_length` when the checkpoint gives one."""
    if pooling.max_seq_length is None:
        return config.max_position_embeddings
    return min(config.max_position_embeddings, pooling.max_seq_length)


def _check_mean_pooling(path: Path) -> None:
    if not path.is_file():
        return
    modes = {k for k, v in _read_json(path).items() if k.startswith("pooling_mode_") and v}
    if modes != {"pooling_mode_mean_tokens"}:
        raise ModelLoadError(
            f"{path}: pooling {', '.join(sorted(modes)) or 'none'} unsupported; "
            "only pooling_mode_mean_tokens"
        )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from None


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # One sentence per row: positions 0..S-1 and token type 0 everywhere.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(hidden)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, S, H], key_mask [B, 1, 1, S] (True = a real token; None: no padding)
        -> [B, S, H]."""
        batch, seq, _ = hidden.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden))
        out = attention(q, k, v, key_mask)
        return out.transpose(1, 2).reshape(batch, seq, -1)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v over [B, heads, S, D]. Padded rows still see the real
    keys of their sequence, so no row is fully masked.

    On the CPU in bfloat16/float16, explicit matmuls with a float32 softmax: at encoder sizes
    (12 heads of 32, tens of tokens) they ran 1.2-2.4x torch's CPU flash attention in bfloat16,
    which is also what `reference_attention` computes. Elsewhere SDPA."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        return reference_attention(q, k, v, key_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """`attention` by explicit matmuls: scores in q's dtype, softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)
    if key_mask is not None:
        scores.masked_fill_(~key_mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(hidden, key_mask), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act_fn = _ACTIVATIONS[config.hidden_act]()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(hidden))


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        hidden = self.attention(hidden, key_mask)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, key_mask)
        return hidden


class BertModel(nn.Module):
    """input_ids, attention_mask [B, S] -> the last layer's token states [B, S, H]. A mask of
    None means no padding (every row S tokens long): attention then runs unmasked."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        key_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        return self.encoder(self.embeddings(input_ids), key_mask)


class BertSentenceEncoder(nn.Module):
    """input_ids, attention_mask [B, S] -> float32 sentence embeddings [B, H]: the mean of the
    real tokens' states, L2-normalised when `normalize` (sentence-transformers' pipeline)."""

    def __init__(self, config: BertConfig, normalize: bool) -> None:
        super().__init__()
        self.bert = BertModel(config)
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """attention_mask None: no padding. Pooling and normalisation run in float32 whatever
        the model's dtype."""
        hidden = self.bert(input_ids, attention_mask).float()
        if attention_mask is None:
            pooled = hidden.mean(dim=1)
        else:
            mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
            # Same clamp as sentence-transformers: an all-padding row gives zeros, not NaN.
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=-1)
        return pooled

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the names loaded.

        Names may carry the `bert.` prefix of task checkpoints; unused tensors are skipped."""
        params = dict(self.bert.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES):
                continue
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"checkpoint tensor {name!r} is not a BERT parameter")
            if param.shape != tensor.shape:
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        return {name for name, _ in self.bert.named_parameters()}


def load_sentence_encoder(
    model_dir: str | Path, *, dtype: torch.dtype, device: torch.device
) -> BertSentenceEncoder:
    """The sentence encoder of the checkpoint in `model_dir` on `device` in `dtype`, eval mode.

    Built on the meta device and filled from memory-mapped safetensors (no random init)."""
    model_dir = Path(model_dir)
    config = load_bert_config(model_dir)
    pooling = load_pooling_config(model_dir)
    with torch.device("meta"):
        model = BertSentenceEncoder(config, pooling.normalize)
    model = model.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
    loaded = model.load_weights(iter_safetensors(find_weight_files(model_dir)))
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"checkpoint in {model_dir} lacks tensor(s): {', '.join(missing[:5])}{more}"
        )
    return model.eval()
