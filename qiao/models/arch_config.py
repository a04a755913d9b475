"""A checkpoint's architecture, read from its config.json without transformers.

Reads both key styles of Hugging Face configs: transformers 4 (`rope_theta`, `rope_scaling`,
`torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qiao.errors import ConfigError, ModelLoadError
from qiao.gguf_file import is_gguf_path
from qiao.layers.int4_checkpoint import Int4CheckpointFormat, read_int4_checkpoint_format
from qiao.layers.rotary import validate_rope_scaling
from qiao.models.registry import supported_architectures

# Used when a config.json lacks `architectures`.
_ARCH_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else a dict with "rope_type" ("linear", "llama3", "longrope") and its
    # parameters (LongRoPE's `original_max_position_embeddings` and `factor` filled in).
    rope_scaling: dict | None
    rotary_dim: int  # leading dims of each head that RoPE rotates (partial: Phi-4-mini)
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (and o, except for Qwen2)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: (
        int | None
    )  # applies to every layer when set (Gemma: `layer_types`' sliding ones)
    fused_checkpoint: bool  # the checkpoint holds qkv_proj and gate_up_proj fused (Phi-3)
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # Mixture of experts (Qwen2-MoE, Qwen3-MoE); num_experts 0: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (dense MLP)
    # Gemma 2 / 3: "sliding_attention" or "full_attention" per layer (empty: every layer slides
    # when sliding_window is set), soft-capping `cap * tanh(x / cap)` of the attention scores and
    # of the final logits, the attention scale's base and the sliding layers' RoPE base.
    layer_types: tuple[str, ...] = ()
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar**-0.5
    rope_local_theta: float | None = None  # None: sliding layers use rope_theta too
    # AWQ / GPTQ checkpoints (`quantization_config`): their 4-bit layout; None: float weights.
    quantization_config: Int4CheckpointFormat | None = None

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The window of layer `layer_index`'s attention (None: it sees the whole context)."""
        if self.layer_types and self.layer_types[layer_index] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer has one: K/V blocks that fall out of it are never read
        again by any layer and may be freed. None when some layer sees the whole context."""
        windows = {self.layer_sliding_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def is_sparse_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` has a mixture-of-experts MLP (transformers' rule)."""
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        if isinstance(self.quantization_config, dict):  # a worker's copy (dataclasses.asdict)
            fmt = Int4CheckpointFormat(**self.quantization_config)
            object.__setattr__(self, "quantization_config", fmt)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )
        activation = "gelu_pytorch_tanh" if self.architecture in _GEMMA_ARCHITECTURES else "silu"
        if self.hidden_act != activation:
            raise ConfigError(
                f"hidden_act: unsupported value {self.hidden_act!r} for {self.architecture}; "
                f"supported: {activation}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window: must be >= 1, got {self.sliding_window}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"partial_rotary_factor: rotary dimension {self.rotary_dim} must be even and "
                f"in (0, head_dim {self.head_dim}]"
            )
        validate_rope_scaling(self.rope_scaling, self.rotary_dim)
        _check_moe(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        """Build from a parsed config.json."""
        architecture = _architecture(d)
        num_heads = _required(d, "num_attention_heads")
        rope_theta, rope_scaling = _rope(d, architecture)
        head_dim = d.get("head_dim") or _required(d, "hidden_size") // num_heads
        eos = d.get("eos_token_id")
        return cls(
            architecture=architecture,
            model_type=d.get("model_type", ""),
            vocab_size=_required(d, "vocab_size"),
            hidden_size=_required(d, "hidden_size"),
            intermediate_size=_required(d, "intermediate_size"),
            num_hidden_layers=_required(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=int(head_dim * _partial_rotary_factor(d)),
            # Gemma ties by default (its config.json often leaves the key out).
            tie_word_embeddings=d.get("tie_word_embeddings", architecture in _GEMMA_ARCHITECTURES),
            # Qwen2 always biases q/k/v; its config.json does not say so. Qwen2-MoE: `qkv_bias`.
            attention_bias=architecture == "Qwen2ForCausalLM"
            or (architecture == "Qwen2MoeForCausalLM" and d.get("qkv_bias", True))
            or d.get("attention_bias", False),
            mlp_bias=d.get("mlp_bias", False),
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            sliding_window=_sliding_window(d, architecture),
            fused_checkpoint=architecture == "Phi3ForCausalLM",
            # Gemma's key is `hidden_activation` (transformers 4 configs also carry hidden_act).
            hidden_act=d.get("hidden_activation") or d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else eos or ()),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            **_moe_fields(d, architecture),
            **_gemma_fields(d, architecture),
            quantization_config=read_int4_checkpoint_format(d.get("quantization_config")),
        )


def load_arch_config(model_dir: str | Path) -> ArchConfig:
    """Read `model_dir/config.json`. Remote code (`auto_map`) is refused, never run. A `.gguf`
    file (or a directory holding one and no config.json) is read by qiao.models.gguf."""
    if is_gguf_path(model_dir):
        from qiao.models.gguf import read_gguf_arch_config  # imports this module

        return read_gguf_arch_config(model_dir)
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"config.json not found: {path}")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if "auto_map" in d or d.get("trust_remote_code"):
        raise ModelLoadError(
            f"{path} asks for remote code (auto_map / trust_remote_code); qiao never runs "
            "code from a checkpoint and supports only its built-in architectures: "
            f"{', '.join(supported_architectures())}"
        )
    return ArchConfig.from_dict(d)


def _required(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ConfigError(f"{key}: missing from config.json")
    return d[key]


def _architecture(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or [_ARCH_OF_MODEL_TYPE.get(d.get("model_type"))]
    if architectures[0] is None:
        raise ConfigError(
            f"architectures: missing from config.json (model_type {d.get('model_type')!r}); "
            f"supported: {', '.join(supported_architectures())}"
        )
    _check_architecture(architectures[0])
    return architectures[0]


def _check_architecture(architecture: str) -> None:
    if architecture not in supported_architectures():
        raise ConfigError(
            f"architectures: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(supported_architectures())}"
        )


def _rope(d: dict[str, Any], architecture: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) with rope_scaling normalised to carry "rope_type"."""
    params = d.get("rope_parameters")
    if architecture == "Gemma3ForCausalLM":  # the global layers' (Gemma 3 keys RoPE by layer type)
        d = _gemma3_rope_config(d, "full_attention")
        params = d.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", d.get("rope_theta", _DEFAULT_ROPE_THETA))
        scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    else:
        theta = d.get("rope_theta", _DEFAULT_ROPE_THETA)
        scaling = {k: v for k, v in (d.get("rope_scaling") or {}).items() if k not in _NOT_SCALING}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    # Phi-3's first long-context configs said "su" (and transformers reads "yarn" there alike).
    if architecture == "Phi3ForCausalLM" and scaling.get("rope_type") in ("su", "yarn"):
        scaling["rope_type"] = "longrope"
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    if scaling["rope_type"] == "longrope":
        _fill_longrope(scaling, d)
    return float(theta), scaling


# Keys of `rope_parameters` that are not the scaling's: read on their own.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def _fill_longrope(scaling: dict[str, Any], d: dict[str, Any]) -> None:
    """LongRoPE as transformers reads it: a top-level `original_max_position_embeddings` wins
    (Phi-3 keeps it there); `factor` defaults to max_position_embeddings over it."""
    original = d.get("original_max_position_embeddings") or scaling.get(
        "original_max_position_embeddings"
    )
    max_positions = d.get("max_position_embeddings", 2048)
    scaling["original_max_position_embeddings"] = original or max_positions
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]


def _partial_rotary_factor(d: dict[str, Any]) -> float:
    """The share of each head RoPE rotates: top-level (transformers 4) or in rope_parameters."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return float(d.get("partial_rotary_factor") or 1.0)


_MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _moe_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen2-MoE / Qwen3-MoE config.json (none otherwise).
    transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`."""
    if architecture not in _MOE_ARCHITECTURES:
        return {}
    if d.get("use_sliding_window"):
        raise ConfigError(
            f"use_sliding_window: {architecture} with a sliding window is not supported; "
            "set it to false"
        )
    return dict(
        num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
        num_experts_per_tok=_required(d, "num_experts_per_tok"),
        moe_intermediate_size=_required(d, "moe_intermediate_size"),
        # Qwen2-MoE always has a shared expert, Qwen3-MoE never.
        shared_expert_intermediate_size=(
            _required(d, "shared_expert_intermediate_size")
            if architecture == "Qwen2MoeForCausalLM"
            else 0
        ),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=d.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
    )


def _check_moe(arch: ArchConfig) -> None:
    if arch.num_experts == 0:
        return
    if not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ConfigError(
            f"num_experts_per_tok: {arch.num_experts_per_tok} must be in "
            f"[1, num_experts {arch.num_experts}]"
        )
    if arch.moe_intermediate_size < 1:
        raise ConfigError(f"moe_intermediate_size: must be >= 1, got {arch.moe_intermediate_size}")
    if arch.decoder_sparse_step < 1:
        raise ConfigError(f"decoder_sparse_step: must be >= 1, got {arch.decoder_sparse_step}")


def _sliding_window(d: dict[str, Any], architecture: str) -> int | None:
    """Mistral and Phi-3 slide whenever `sliding_window` is set; Qwen2/3 only with
    `use_sliding_window`, and then only on layers from `max_window_layers` on. qiao supports all
    or none."""
    window = d.get("sliding_window")
    # Gemma: the window of the layers `layer_types` names sliding (`_gemma_fields`).
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", *_GEMMA_ARCHITECTURES):
        return window
    if window is None:
        return window
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        return None
    if not d.get("use_sliding_window", False):
        return None
    num_layers = _required(d, "num_hidden_layers")
    layer_types = d.get("layer_types") or [
        "sliding_attention" if i >= d.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    num_sliding = layer_types.count("sliding_attention")
    if 0 < num_sliding < num_layers:
        raise ConfigError(
            f"layer_types: {num_sliding} of {num_layers} layers use a sliding window "
            "(max_window_layers); qiao supports a window on all layers or none"
        )
    return window if num_sliding else None


_GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _gemma_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Gemma 2 / 3: per-layer window alternation, soft-capping, the attention scale, the
    activation (`hidden_activation`) and Gemma 3's RoPE base for sliding layers."""
    if architecture not in _GEMMA_ARCHITECTURES:
        return {}
    if d.get("use_bidirectional_attention"):
        raise ConfigError(
            "use_bidirectional_attention: bidirectional (encoder) Gemma is not supported; "
            "set it to false"
        )
    num_layers = _required(d, "num_hidden_layers")
    # transformers 4 configs: Gemma 2 alternates from a sliding layer 0; Gemma 3 has one global
    # layer in every `sliding_window_pattern` (6).
    pattern = 2 if architecture == "Gemma2ForCausalLM" else d.get("sliding_window_pattern") or 6
    layer_types = tuple(
        d.get("layer_types")
        or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    )
    if len(layer_types) != num_layers or not set(layer_types) <= _LAYER_TYPES:
        raise ConfigError(
            f"layer_types: need {num_layers} entries, each one of {sorted(_LAYER_TYPES)}; "
            f"got {list(layer_types)}"
        )
    if "sliding_attention" in layer_types and not d.get("sliding_window"):
        raise ConfigError("sliding_window: required when layer_types has sliding_attention layers")
    fields: dict[str, Any] = dict(
        layer_types=layer_types,
        attn_logit_softcapping=d.get("attn_logit_softcapping"),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
    )
    if architecture == "Gemma3ForCausalLM":
        local_theta, local_scaling = _rope(_gemma3_rope_config(d, "sliding_attention"), "")
        if local_scaling is not None:
            raise ConfigError(
                "rope_parameters.sliding_attention: scaled RoPE on sliding layers is not "
                "supported; use rope_type default"
            )
        fields["rope_local_theta"] = local_theta
    return fields


_LAYER_TYPES = {"sliding_attention", "full_attention"}
_GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _gemma3_rope_config(d: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """A Gemma 3 config.json seen as one layer type's plain RoPE config. transformers 5 keys
    `rope_parameters` by layer type; transformers 4 wrote `rope_theta` and `rope_scaling` for
    the global layers and `rope_local_base_freq` for the sliding ones."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return {**d, "rope_parameters": params[layer_type]}
    rest = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling")}
    if layer_type == "full_attention":
        theta = d.get("rope_theta", _GEMMA3_DEFAULT_THETA[layer_type])
        return {**rest, "rope_theta": theta, "rope_scaling": d.get("rope_scaling")}
    theta = d.get("rope_local_base_freq", _GEMMA3_DEFAULT_THETA[layer_type])
    return {**rest, "rope_theta": theta}
