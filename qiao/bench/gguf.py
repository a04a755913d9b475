"""GGUF files from Hugging Face checkpoints, and `qiao bench gguf`: qiao against llama.cpp.

`write_gguf` lays a checkpoint out as llama.cpp's `convert_hf_to_gguf.py` does: its tensor names,
the llama arch's q/k rows permuted to adjacent rotary pairs, matrices in the chosen type (norms
and biases F32), the architecture and tokenizer under its metadata keys. The tests make their
files with it and check them against transformers' own GGUF reader; the benchmark makes the one
file both engines load.

`run_gguf_bench` loads that file in qiao and in llama-cpp-python (an optional extra:
`pip install "qiao[llamacpp]"`, which builds llama.cpp from source) and measures batch-1 decode
tokens/s and offline throughput on the same prompts, one engine at a time.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

# qiao architecture -> GGUF arch name (Mistral converts as llama).
_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K")


def write_gguf(checkpoint: str | Path, out: str | Path, file_type: str = "F32") -> Path:
    """Convert the Hugging Face checkpoint folder `checkpoint` to the GGUF file `out`, every
    matrix in `file_type` (one of FILE_TYPES; Q4_K needs input features in multiples of 256)."""
    import gguf
    from safetensors.torch import load_file

    from qiao.models.arch_config import load_arch_config

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r}; expected one of {FILE_TYPES}")
    checkpoint, out = Path(checkpoint), Path(out)
    arch = load_arch_config(checkpoint)
    name = _GGUF_ARCH[arch.architecture]
    config = json.loads((checkpoint / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), name)
    writer.add_name(checkpoint.name)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_hidden_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_attention_heads)
    writer.add_head_count_kv(arch.num_key_value_heads)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    writer.add_rope_dimension_count(arch.rotary_dim)
    if arch.head_dim != arch.hidden_size // arch.num_attention_heads:
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    if arch.sliding_window is not None:
        writer.add_sliding_window(arch.sliding_window)
    if arch.num_experts:
        writer.add_expert_count(arch.num_experts)
        writer.add_expert_used_count(arch.num_experts_per_tok)
        writer.add_expert_feed_forward_length(arch.moe_intermediate_size)
        if arch.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(arch.shared_expert_intermediate_size)
        writer.add_expert_weights_norm(arch.norm_topk_prob)
    writer.add_file_type(_FILE_TYPE_IDS[file_type])
    _add_tokenizer(writer, checkpoint, arch.vocab_size, config)

    weights = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(path))
    gguf_names = _gguf_names(name)
    for hf, tensor in _split_stacked_experts(weights, arch.moe_intermediate_size):
        if arch.tie_word_embeddings and hf == "lm_head.weight":
            continue
        gguf_name = gguf_names(hf)
        data = tensor.float().numpy()
        if name == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            data = _permute(data, arch.num_attention_heads)
        elif name == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute(data, arch.num_key_value_heads)
        kind = file_type if data.ndim >= 2 else "F32"
        writer.add_tensor(gguf_name, *_encode(data, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


_FILE_TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K": 15, "BF16": 32}


def _split_stacked_experts(weights: dict, moe_size: int) -> Any:
    """(name, tensor) with transformers 5's stacked experts as llama.cpp's three:
    `mlp.experts.gate_up_proj` [E, 2I, H] -> `mlp.experts.gate_proj` and `up_proj` [E, I, H],
    per-expert `mlp.experts.{e}.*_proj.weight` stacked alike."""
    import torch

    per_expert: dict[tuple[str, str], dict[int, Any]] = {}
    for name, tensor in weights.items():
        prefix, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            yield name, tensor
        elif rest == "gate_up_proj":
            yield f"{prefix}.mlp.experts.gate_proj", tensor[:, :moe_size]
            yield f"{prefix}.mlp.experts.up_proj", tensor[:, moe_size:]
        elif rest == "down_proj":
            yield f"{prefix}.mlp.experts.down_proj", tensor
        else:  # "{e}.gate_proj.weight"
            expert, _, part = rest.partition(".")
            per_expert.setdefault((prefix, part.removesuffix(".weight")), {})[int(expert)] = tensor
    for (prefix, part), experts in per_expert.items():
        yield f"{prefix}.mlp.experts.{part}", torch.stack([experts[e] for e in sorted(experts)])


_EXPERT_GGUF = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def _gguf_names(arch: str) -> Callable[[str], str]:
    """Hugging Face name -> llama.cpp name (qiao.models.gguf's mapping, inverted)."""
    from qiao.models.gguf import _BLOCK_NAMES, _GLOBAL_NAMES, _PHI3_BLOCK_NAMES

    blocks = {hf: g for g, hf in (_PHI3_BLOCK_NAMES if arch == "phi3" else _BLOCK_NAMES).items()}
    globals_ = {hf: g for g, hf in _GLOBAL_NAMES.items()}

    def convert(name: str) -> str:
        prefix, sep, part = name.partition(".mlp.experts.")
        if sep:
            return f"blk.{prefix.rpartition('.')[2]}.{_EXPERT_GGUF[part]}.weight"
        base, _, leaf = name.rpartition(".")
        if base in globals_:
            return f"{globals_[base]}.{leaf}"
        _, _, rest = base.partition("model.layers.")
        layer, _, module = rest.partition(".")
        return f"blk.{layer}.{blocks[module]}.{leaf}"

    return convert


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: each head's rows as adjacent rotary pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _encode(data: np.ndarray, kind: str) -> tuple[np.ndarray, ...]:
    """(tensor, raw_shape, raw_dtype) arguments of GGUFWriter.add_tensor for `kind`."""
    from gguf import GGMLQuantizationType, quants

    if kind == "F32":
        return (data.astype(np.float32),)
    if kind == "F16":
        return (data.astype(np.float16),)
    qtype = GGMLQuantizationType[kind]
    block = 256 if kind == "Q4_K" else 32
    if data.shape[-1] % block:  # as llama.cpp's converter does: F16 where blocks do not fit
        return (data.astype(np.float16),)
    if kind == "Q4_K":
        return quantize_q4_k(data), None, qtype
    return quants.quantize(data, qtype), None, qtype


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> Q4_K bytes [N, K / 256 * 144], min/max per
    sub-block of 32 (the gguf package has no Q4_K quantizer; llama.cpp's searches its scales,
    this one does not, but it writes the same format)."""
    n, k = w.shape
    if k % 256:
        raise ValueError(f"Q4_K needs input features in multiples of 256, got {k}")
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # [N, B, 8], <= 0 so the min is an offset >= 0
    scale = (sub.max(axis=-1) - low) / 15.0
    d = np.maximum(scale.max(axis=-1), 1e-12) / 63.0  # [N, B]
    dmin = np.maximum((-low).max(axis=-1), 1e-12) / 63.0
    d, dmin = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.round((sub + offset[..., None]) / np.maximum(step, 1e-30)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # sub-blocks 2c (low) and 2c+1 (high nibble)
    packed = np.empty((n, k // 256, 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    blocks = np.concatenate(
        [
            d[..., None].view(np.uint8),
            dmin[..., None].view(np.uint8),
            packed,
            qs.reshape(n, k // 256, 128),
        ],
        axis=-1,
    )
    return blocks.reshape(n, -1)


def _add_tokenizer(writer: Any, checkpoint: Path, vocab_size: int, config: dict) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary: tokens in id order
    (padded to the model's vocabulary), merges, token types (special ones CONTROL), the
    special ids and the chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model["type"] != "BPE":
        raise ValueError(f"write_gguf writes byte-level BPE tokenizers, not {model['type']}")
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    special = set(tokenizer.all_special_ids)
    types = [
        3 if i in special else (5 if i not in by_id else 1)  # CONTROL, UNUSED, NORMAL
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
    ):
        token_id = getattr(tokenizer, key, None)
        if token_id is None:
            token_id = config.get(key)
        if isinstance(token_id, int):
            add(token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


# --- the benchmark ----------------------------------------------------------------------------

LLAMACPP_INSTALL = (
    'pip install "qiao[llamacpp]" (or CMAKE_ARGS="-DGGML_NATIVE=ON" pip install '
    '"llama-cpp-python>=0.3"; it builds llama.cpp from source, several minutes)'
)


@dataclass(frozen=True)
class GGUFBenchConfig:
    """`qiao bench gguf`: one GGUF file (given, or made from a built-in shape with random
    weights), loaded by qiao and by llama.cpp in turn, measured on the same prompts."""

    gguf: str | None = None
    shape: str | None = None  # qiao/bench/shapes.py; the file is written in `file_type`
    file_type: str = "F32"
    prompt_len: int = 128
    output_len: int = 64
    batch: int = 16  # offline: this many prompts
    repeats: int = 3
    threads: int | None = None  # None: torch's thread count
    workdir: str | None = None  # where a made file goes (default: a temporary folder)
    engines: tuple[str, ...] = ("qiao", "llama.cpp")


def run_gguf_bench(cfg: GGUFBenchConfig) -> dict[str, Any]:
    import tempfile

    import torch

    threads = cfg.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory(dir=cfg.workdir) as tmp:
        path = Path(cfg.gguf) if cfg.gguf else make_shape_gguf(cfg.shape, cfg.file_type, Path(tmp))
        from qiao.models.gguf import open_gguf, read_gguf_arch_config

        arch = read_gguf_arch_config(path)
        kinds = sorted({t.tensor_type.name for t in open_gguf(path).tensors.values()})
        rng = np.random.default_rng(0)
        # Prompts of ordinary tokens (past the first few ids, where special tokens sit).
        prompts = [
            rng.integers(16, arch.vocab_size, cfg.prompt_len).tolist()
            for _ in range(max(cfg.batch, cfg.repeats))
        ]
        results: dict[str, Any] = {}
        for engine in cfg.engines:
            run = {"qiao": _bench_qiao, "llama.cpp": _bench_llamacpp}[engine]
            results[engine] = run(path, prompts, cfg, threads)
        report = {
            "benchmark": "gguf",
            "file": path.name if cfg.gguf else f"{cfg.shape} {cfg.file_type} (random weights)",
            "file_bytes": path.stat().st_size,
            "tensor_types": kinds,
            "architecture": arch.architecture,
            "config": asdict(cfg),
            "threads": threads,
            "machine": _machine(),
            "results": results,
        }
    a, b = (results.get(e, {}) for e in ("qiao", "llama.cpp"))
    if a.get("greedy_tokens") and b.get("greedy_tokens"):
        agree = 0
        for x, y in zip(a["greedy_tokens"], b["greedy_tokens"], strict=False):
            if x != y:
                break
            agree += 1
        report["greedy_agreeing_prefix"] = agree
    return report


def make_shape_gguf(shape: str | None, file_type: str, folder: Path) -> Path:
    """A GGUF of built-in `shape` with random weights (transformers' init) and a small
    byte-level BPE vocabulary padded to the shape's vocabulary size."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qiao.bench.shapes import write_shape_dir

    if shape is None:
        raise ValueError("qiao bench gguf needs --gguf FILE or --shape NAME")
    source = write_shape_dir(shape, folder / "source")
    config = transformers.AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(source)
    del model
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_VOCAB_TEXT] * 4, trainer=trainer)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    ).save_pretrained(source)
    return write_gguf(source, folder / f"{shape}-{file_type}.gguf", file_type)


_VOCAB_TEXT = (
    "Once upon a time there was a little fox who lived at the edge of a quiet forest. The "
    "engine schedules requests, runs the model on a flat batch of tokens and samples the next "
    "token of every sequence. Numbers too: 3.14159, 42, 1024 tokens; print('hello, world!')."
)


def _bench_qiao(path: Path, prompts: list[list[int]], cfg: GGUFBenchConfig, threads: int) -> dict:
    from qiao.entrypoints.llm import LLM
    from qiao.sampling_params import SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=str(path),
        num_threads=threads,
        max_num_seqs=cfg.batch,
        max_model_len=cfg.prompt_len + cfg.output_len + 16,
        enable_prefix_caching=False,
        profile=None,
    )
    load_s = time.perf_counter() - started
    engine = llm.engine
    params = SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    decode, prefill, tokens = [], [], []
    for i in range(cfg.repeats):
        engine.add_request(f"b1-{i}", prompts[i], params)
        # The first step prefills the prompt (one chunk: prompt_len <= the step's token budget)
        # and samples the first token; each later step decodes one.
        t0 = time.perf_counter()
        outputs = engine.step()
        first = time.perf_counter()
        while not any(out.finished for out in outputs):
            outputs = engine.step()
        end = time.perf_counter()
        tokens = tokens or list(next(o for o in outputs if o.finished).outputs[0].token_ids)
        prefill.append(first - t0)
        decode.append((cfg.output_len - 1) / (end - first))
    offline = []
    for _ in range(cfg.repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts[: cfg.batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        offline.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    methods = sorted({m.method.name for m in engine.runner.model.modules() if hasattr(m, "method")})
    return {
        "version": _version("qiao"),
        "load_s": round(load_s, 2),
        "linear_methods": methods,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "batch1_prefill_s": round(statistics.median(prefill), 4),
        "batch1_decode_tok_s": round(statistics.median(decode), 2),
        "offline_output_tok_s": round(statistics.median(offline), 2),
        "greedy_tokens": tokens,
        "runs": {"batch1_decode_tok_s": decode, "offline_output_tok_s": offline},
    }


def _bench_llamacpp(
    path: Path, prompts: list[list[int]], cfg: GGUFBenchConfig, threads: int
) -> dict:
    try:
        import llama_cpp
    except ImportError:
        return {"skipped": f"llama-cpp-python is not installed: {LLAMACPP_INSTALL}"}
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=cfg.prompt_len + cfg.output_len + 16,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    load_s = time.perf_counter() - started

    def generate(prompt: list[int], n: int) -> tuple[list[int], float, float]:
        """(tokens, seconds to the first, seconds in all): greedy, one sequence."""
        t0 = time.perf_counter()
        out, first = [], None
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first = time.perf_counter()
            out.append(token)
            if len(out) == n:
                break
        return out, first - t0, time.perf_counter() - t0

    generate(prompts[0], 4)
    decode, prefill, tokens = [], [], []
    for i in range(cfg.repeats):
        out, first, total = generate(prompts[i], cfg.output_len)
        tokens = tokens or out
        prefill.append(first)
        decode.append((cfg.output_len - 1) / (total - first))
    offline = []
    for _ in range(cfg.repeats):
        t0 = time.perf_counter()
        count = sum(len(generate(p, cfg.output_len)[0]) for p in prompts[: cfg.batch])
        offline.append(count / (time.perf_counter() - t0))
    return {
        "version": llama_cpp.__version__,
        "load_s": round(load_s, 2),
        "batch1_prefill_s": round(statistics.median(prefill), 4),
        "batch1_decode_tok_s": round(statistics.median(decode), 2),
        # llama-cpp-python's Llama runs one sequence at a time: the prompts one after another.
        "offline_output_tok_s": round(statistics.median(offline), 2),
        "greedy_tokens": tokens,
        "runs": {"batch1_decode_tok_s": decode, "offline_output_tok_s": offline},
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _machine() -> dict[str, Any]:
    import os
    import platform

    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__}


def format_gguf_bench(report: dict[str, Any]) -> str:
    lines = [
        f"GGUF: {report['file']} ({report['file_bytes'] / 1e6:.1f} MB, "
        f"{', '.join(report['tensor_types'])}), {report['threads']} threads, "
        f"{report['machine']['cpu']}",
        f"{'engine':<10} {'load s':>7} {'prefill s':>10} {'b1 decode tok/s':>16} "
        f"{'offline tok/s':>14}",
    ]
    for engine, r in report["results"].items():
        if "skipped" in r:
            lines.append(f"{engine:<10} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{engine:<10} {r['load_s']:>7.2f} {r['batch1_prefill_s']:>10.4f} "
            f"{r['batch1_decode_tok_s']:>16.2f} {r['offline_output_tok_s']:>14.2f}"
        )
    if "greedy_agreeing_prefix" in report:
        n = report["config"]["output_len"]
        lines.append(
            f"greedy tokens agreeing from the start: {report['greedy_agreeing_prefix']}/{n}"
        )
    return "\n".join(lines)
