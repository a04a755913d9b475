"""Multi-LoRA decode step time: `qiao bench lora [--layers N] [--rank R]`.

One run, side by side: an engine without LoRA, then one with `enable_lora` whose decode steps
run 0, 1 and 4 distinct adapters (random PEFT-format adapters of rank R on all seven
projections) over the same batch of sequences (4 adapters: interleaved, so each layer gathers
its rows, then with the sequences grouped by adapter, so it works on slices); and, per projection shape, the grouped LoRA
computation (`LoRASlots.apply`) against a bgmv-style batched gather (`torch.bmm` over each
token's own A and B) at the same decode rows. Random weights of the SmolLM2-135M shape
(`load_format="dummy"`), float32, CPU. Medians of the timed steps; wrap the run in
`flock /tmp/qiao-bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from qiao.entrypoints.llm import LLM
from qiao.lora import LoRARequest
from qiao.lora.slots import LoRAContext, LoRASlots, build_plan
from qiao.sampling_params import SamplingParams

# SmolLM2-135M's shape.
_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    torch_dtype="float32",
    bos_token_id=0,
    eos_token_id=0,
)
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Projection -> (in, out) features."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(path: Path, config: dict, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter folder of rank `rank` on every projection."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (k, n) in _shapes(config).items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=_TARGETS)
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def decode_step_ms(llm: LLM, loras: list, prompt_len: int, steps: int) -> float:
    """Median ms of `steps` decode steps of len(loras) sequences (sequence i under loras[i])."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i, lora in enumerate(loras):
        prompt = rng.integers(1, 1000, prompt_len).tolist()
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, lora_request=lora)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or (
        engine.scheduler.num_waiting
    ):
        engine.step()
    engine.step()  # the first decode step loads the step's adapters into their slots
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.abort_request(list(engine.output_processor.states))
    return 1000 * statistics.median(times)


def bgmv(x: torch.Tensor, layer: LoRASlots, token_slots: torch.Tensor) -> torch.Tensor:
    """The batched-gather alternative: each token's own A and B gathered, two bmm."""
    shrunk = torch.bmm(layer.lora_a[token_slots], x[:, :, None])
    return torch.bmm(layer.lora_b[token_slots], shrunk)[:, :, 0]


def layer_us(rows: int, k: int, n: int, rank: int, num_adapters: int) -> tuple[float, float]:
    """Median microseconds of the grouped LoRA and of bgmv at `rows` decode rows."""
    context = LoRAContext()
    layer = LoRASlots(
        context,
        input_size=k,
        part_sizes=[n],
        num_slots=num_adapters + 1,
        max_lora_rank=rank,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for slot in range(1, num_adapters + 1):
        layer.set_slot(slot, {None: (torch.randn(rank, k), torch.randn(n, rank))})
    slots = np.arange(rows) % num_adapters + 1
    context.plan = build_plan(slots, np.ones(rows, np.int64), torch.device("cpu"))
    x, y = torch.randn(rows, k), torch.zeros(rows, n)
    token_slots = context.plan.token_slots

    def median_us(fn) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(200):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return 1e6 * statistics.median(times)

    return median_us(lambda: layer.apply(x, y)), median_us(lambda: bgmv(x, layer, token_slots))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = {**_CONFIG, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory() as root:
        model_dir = Path(root) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        adapters = [
            LoRARequest(
                f"a{i}", i + 1, str(write_adapter(Path(root) / f"a{i}", config, args.rank, i))
            )
            for i in range(4)
        ]
        common = dict(
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cpu",
            dtype="float32",
            num_kv_blocks=256,
            max_num_seqs=args.seqs,
            profile=None,
        )
        n = args.seqs
        results = {
            "no LoRA engine": decode_step_ms(
                LLM(str(model_dir), **common), [None] * n, 32, args.steps
            )
        }
        llm = LLM(str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
        results["LoRA engine, 0 adapters"] = decode_step_ms(llm, [None] * n, 32, args.steps)
        results["LoRA engine, 1 adapter"] = decode_step_ms(llm, [adapters[0]] * n, 32, args.steps)
        four = [adapters[i % 4] for i in range(n)]
        results["LoRA engine, 4 adapters"] = decode_step_ms(llm, four, 32, args.steps)
        grouped = sorted(four, key=lambda lora: lora.lora_int_id)
        results["  the same, grouped"] = decode_step_ms(llm, grouped, 32, args.steps)
    print(f"decode step, {n} sequences, {args.layers} layers, rank {args.rank} (median ms):")
    for label, ms in results.items():
        print(f"  {label:28s} {ms:8.2f}")
    print(f"one projection's LoRA at {n} decode rows, 4 adapters (median us): grouped / bgmv")
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    for label, (k, nn_) in {"576 -> 576": (hidden, hidden), "576 -> 1536": (hidden, inter)}.items():
        grouped, gathered = layer_us(n, k, nn_, args.rank, 4)
        print(f"  {label:12s} {grouped:8.1f} / {gathered:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
