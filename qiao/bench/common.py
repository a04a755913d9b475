"""What the offline benchmarks share: length distributions, the model under test, random
prompts, the engine build, and JSON output."""

from __future__ import annotations

import contextlib
import json
import random
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qiao.bench.shapes import write_shape_dir
from qiao.errors import ConfigError

if TYPE_CHECKING:
    from qiao.entrypoints.llm import LLM


# Benchmark texts are random words from this list: common English words, about one token each
# for BPE and WordPiece vocabularies, so a length in words is roughly one in tokens.
_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force
"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class LengthSpec:
    """A length: fixed ("128") or uniform over an inclusive range ("64:256")."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        lo_text, sep, hi_text = text.partition(":")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise ValueError(f"length {text!r}: expected N or LO:HI (integers)") from None
        if not 1 <= lo <= hi:
            raise ValueError(f"length {text!r}: need 1 <= LO <= HI")
        return cls(lo, hi)

    def sample(self, rng: random.Random, count: int) -> list[int]:
        return [rng.randint(self.lo, self.hi) for _ in range(count)]

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


@dataclass(frozen=True)
class Workload:
    """Prompts (random token ids) and how many tokens to generate after each."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_prompts: int, input_len: LengthSpec, output_len: LengthSpec, vocab_size: int, seed: int
) -> Workload:
    """Seeded random token-id prompts. Ids are drawn uniformly from the whole vocabulary: with
    random weights no id is special, and EOS is ignored."""
    rng = random.Random(seed)
    input_lens = input_len.sample(rng, num_prompts)
    output_lens = output_len.sample(rng, num_prompts)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


@contextlib.contextmanager
def model_dir(model: str | None, shape: str | None) -> Iterator[Path]:
    """The checkpoint directory under test: `model` itself, or a temporary directory holding
    the built-in `shape`'s config.json (removed afterwards)."""
    if (model is None) == (shape is None):
        raise ConfigError("give exactly one of --model and --shape")
    if model is not None:
        yield Path(model).expanduser()
        return
    with tempfile.TemporaryDirectory(prefix=f"qiao-bench-{shape}-") as tmp:
        yield write_shape_dir(shape, tmp)


@dataclass(frozen=True)
class EngineArgs:
    """How to build the engine under test (the `LLM` keyword arguments a benchmark varies)."""

    load_format: str
    dtype: str
    quantization: str | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int = 0
    device: str = "auto"
    cuda_graphs: bool | None = None  # None: the device's default (on for CUDA)
    kv_cache_dtype: str = "auto"


def context_len(num_tokens: int) -> int:
    """`max_model_len` for sequences of up to `num_tokens` (prompt + output).

    The engine's default KV pool holds max_num_seqs sequences of this length, in whole blocks.
    """
    return num_tokens


def build_llm(path: Path, args: EngineArgs) -> LLM:
    """An `LLM` without tokenizer or tuning profile (a benchmark sets what it measures).
    Prefix caching is off: a benchmark measures computing prompts, and reruns of the same
    prompts would otherwise be cache hits."""
    from qiao.entrypoints.llm import LLM

    kwargs: dict[str, Any] = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=args.seed,
        profile=None,
        device=args.device,
        cuda_graphs=args.cuda_graphs,
    )
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization  # LLM() names it if it is not supported
    return LLM(str(path), **kwargs)


def device_note(report: dict[str, Any]) -> str:
    """E.g. ", on cuda:0 with CUDA graphs" for a report's heading; "" when it names no device."""
    device = report.get("device")
    if device is None:
        return ""
    return f", on {device}" + (" with CUDA graphs" if report.get("cuda_graphs") else "")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return numerator / denominator


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def weight_bytes_per_decode_step(model: Any, num_seqs: int = 1) -> int:
    """Bytes of weights one decode step of `num_seqs` sequences reads: every parameter and
    weight buffer once, except the input embedding table, of which a step reads only one row
    per sequence, and the routed experts of a mixture-of-experts layer. The lm_head is read
    whole, whether it is its own tensor, the tied embedding or a packed / int8 copy. int8
    layers' bfloat16 copies (`weight_bf16`) serve only batches too large for the int8 kernel.

    Experts (`FusedMoE` layers): a step reads only those its tokens route to. The model of
    routing is uniform and independent: each of the `num_seqs` tokens picks k of the E experts,
    so an expert is missed by one token with probability 1 - k/E and the expected number hit
    is E * (1 - (1 - k/E) ** num_seqs), at most E (reached at k = E). Each expert layer counts
    at that share of its bytes; its router and shared expert are read whole, and the dense
    MLPs of `mlp_only_layers` / `decoder_sparse_step` are read whole as any dense layer's.
    (The sync-free form CUDA graphs capture runs every expert; this counts the routed reads.)
    """
    if num_seqs < 1:
        raise ValueError(f"num_seqs: must be >= 1, got {num_seqs}")
    expert_layers = _expert_layer_prefixes(model)
    share = _expert_share_read(model, num_seqs) if expert_layers else 1.0
    dense, routed = 0, 0
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for name, tensor in tensors:
        if "rotary" in name or "embed_tokens" in name or name.endswith("weight_bf16"):
            continue
        num_bytes = tensor.numel() * tensor.element_size()
        if name.startswith(expert_layers):
            routed += num_bytes
        else:
            dense += num_bytes
    return dense + round(routed * share)


def _expert_layer_prefixes(model: Any) -> tuple[str, ...]:
    """E.g. ("model.layers.1.mlp.experts.", ...): where the model's `FusedMoE` layers sit."""
    from qiao.layers.fused_moe import FusedMoE

    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, FusedMoE))


def _expert_share_read(model: Any, num_seqs: int) -> float:
    """The expected share of a layer's experts that `num_seqs` tokens route to (the model of
    `weight_bytes_per_decode_step`): 1 - (1 - k/E) ** num_seqs. E.g. E 60, k 4: 1/15 at one
    sequence, 0.42 at 8, 0.99 at 64."""
    num_experts, top_k = model.arch.num_experts, model.arch.num_experts_per_tok
    return min(1.0, 1.0 - (1.0 - top_k / num_experts) ** num_seqs)
