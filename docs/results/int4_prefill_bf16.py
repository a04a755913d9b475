"""int4 prefill on the Qwen2.5-0.5B shapes: float32 tiles (before) against bfloat16 tiles
(after), beside int8, bfloat16 and a whole prepacked bfloat16 copy of the int4 weight (the
alternative that costs memory), all in one process, timed in interleaved rounds (the order
rotating) so the load other work puts on the machine falls on every variant alike.

python docs/results/int4_prefill_bf16.py OUT.json ROUNDS [linears|tiles|split|model ...]
(run under `flock /tmp/qiao-bench.lock`)."""

import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from qiao.layers import quant_int4
from qiao.layers.linear import LinearBase
from qiao.layers.linear_method import Int8Method, OneDnnMethod

SHAPES = {  # name: (K, N) of the Qwen2.5-0.5B linears (gate_up is the merged pair)
    "qkv 896->1152": (896, 1152),
    "o 896->896": (896, 896),
    "up 896->4864": (896, 4864),
    "gate_up 896->9728": (896, 9728),
    "down 4864->896": (4864, 896),
    "head 896->151936": (896, 151936),
}
ROWS = (64, 256, 512)


def timed(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def interleaved(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant over `rounds`, one call of each per round."""
    names = list(variants)
    for fn in variants.values():
        fn()  # warm-up: oneDNN primitives, first-touch pages
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(timed(variants[name]))
    return {n: statistics.median(s) for n, s in samples.items()}


def with_bf16_tiles(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        before = quant_int4.PREFILL_BF16
        quant_int4.PREFILL_BF16 = on
        try:
            return fn()
        finally:
            quant_int4.PREFILL_BF16 = before

    return run


def layers(k: int, n: int) -> dict[str, LinearBase]:
    weight = torch.randn(n, k) * 0.05
    made = {}
    for name, method in (
        ("int4", quant_int4.Int4Method()),
        ("int8", Int8Method(64)),
        ("bfloat16", OneDnnMethod(64)),
    ):
        layer = LinearBase(k, n, False)
        layer.weight.data = weight.to(torch.bfloat16) if name == "bfloat16" else weight.clone()
        layer.method = method
        method.prepare(layer)
        made[name] = layer
    return made


def prepacked_bf16(layer: LinearBase) -> torch.Tensor:
    """The int4 weight dequantized once, rounded to bfloat16 and prepacked for oneDNN."""
    p = quant_int4.PackedInt4(
        layer.weight,
        layer.weight_scales,
        layer.weight_offsets,
        layer.int4_group_size,
        layer.output_size,
    )
    dense = quant_int4.dequantize_int4(quant_int4.unpack_int4(p))[: layer.output_size]
    return torch.ops.mkldnn._reorder_linear_weight(dense.to(torch.bfloat16), 64)


def linear_variants(made: dict[str, LinearBase], x: torch.Tensor) -> dict:
    int4, packed = made["int4"], prepacked_bf16(made["int4"])
    xb = x.to(torch.bfloat16)
    return {
        "int4 float32 tiles (before)": with_bf16_tiles(False, lambda: int4(x)),
        "int4 bfloat16 tiles (after)": with_bf16_tiles(True, lambda: int4(x)),
        "int4 prepacked bfloat16 copy": lambda: torch.ops.mkldnn._linear_pointwise(
            xb, packed, None, "none", [], ""
        ).float(),
        "int8": lambda: made["int8"](x),
        "bfloat16": lambda: made["bfloat16"](xb),
    }


def bench_linears(rounds: int) -> dict:
    report = {}
    for shape, (k, n) in SHAPES.items():
        made = layers(k, n)
        for rows in ROWS:
            x = torch.randn(rows, k)
            head = shape.startswith("head")
            times = interleaved(linear_variants(made, x), max(3, rounds // 3) if head else rounds)
            flops = 2 * rows * k * n
            report[f"{shape} x{rows}"] = {
                name: {"ms": t * 1e3, "gflops": flops / t / 1e9} for name, t in times.items()
            }
            print(shape, rows, {m: round(t * 1e3, 2) for m, t in times.items()}, flush=True)
        del made
        gc.collect()
    return report


def bench_tiles(rounds: int) -> dict:
    """Elements per bfloat16 tile against the time of one linear."""
    report = {}
    for shape in ("qkv 896->1152", "gate_up 896->9728", "down 4864->896"):
        k, n = SHAPES[shape]
        layer = layers(k, n)["int4"]
        for rows in (64, 512):
            x = torch.randn(rows, k)
            variants = {}
            for bits in (17, 18, 19, 20, 21, 22):

                def run(bits: int = bits, layer: LinearBase = layer, x: torch.Tensor = x) -> object:
                    quant_int4.BF16_TILE_ELEMENTS = 1 << bits
                    return layer(x)

                variants[f"2^{bits}"] = run
            default = quant_int4.BF16_TILE_ELEMENTS
            times = interleaved(variants, rounds)
            quant_int4.BF16_TILE_ELEMENTS = default
            report[f"{shape} x{rows}"] = {t: s * 1e3 for t, s in times.items()}
            print(shape, rows, {t: round(s * 1e3, 2) for t, s in times.items()}, flush=True)
    return report


def bench_split(rounds: int) -> dict:
    """Where one int4 linear's time goes: dequantizing every tile, multiplying them (already
    dequantized), at 2 threads and 1."""
    report = {}
    ops = quant_int4.int4_ops()
    for shape in ("gate_up 896->9728", "down 4864->896"):
        k, n = SHAPES[shape]
        layer = layers(k, n)["int4"]
        blocks = layer.weight.shape[0]
        args = (
            layer.weight,
            layer.weight_scales,
            layer.weight_offsets,
            layer.int4_group_size,
            n,
            k,
        )
        float32_step = max(4, quant_int4._TILE_ELEMENTS // (k * 16))
        bf16_step = max(4, quant_int4.BF16_TILE_ELEMENTS // (k * 16))
        buffer = torch.empty(k, 16 * bf16_step, dtype=torch.bfloat16)

        def float32_tiles(step: int = float32_step, args: tuple = args, blocks: int = blocks):
            return [
                ops.int4_dequantize(*args, b, min(step, blocks - b)) for b in range(0, blocks, step)
            ]

        def bf16_tiles(
            step: int = bf16_step, args: tuple = args, blocks: int = blocks, buffer=buffer
        ):
            tiles = []
            for b in range(0, blocks, step):
                size = min(step, blocks - b)
                tile = buffer if size == step else buffer.new_empty(buffer.shape[0], 16 * size)
                ops.int4_dequantize_bf16(*args, b, size, tile)
                tiles.append(tile)
            return tiles

        for label, dequantize, dtype in (
            ("float32", float32_tiles, torch.float32),
            ("bfloat16", bf16_tiles, torch.bfloat16),
        ):
            tiles = dequantize()
            for rows in (64, 512):
                x = torch.randn(rows, k, dtype=dtype)
                for threads in (2, 1):
                    torch.set_num_threads(threads)
                    times = interleaved(
                        {
                            "dequantize": dequantize,
                            "matmul": lambda x=x, tiles=tiles: [x @ t for t in tiles],
                            "layer": with_bf16_tiles(
                                label == "bfloat16", lambda x=x, layer=layer: layer(x.float())
                            ),
                        },
                        rounds,
                    )
                    key = f"{shape} {label} tiles x{rows} threads={threads}"
                    report[key] = {t: s * 1e3 for t, s in times.items()}
                    print(key, {t: round(s * 1e3, 2) for t, s in times.items()}, flush=True)
                torch.set_num_threads(2)
    return report


def bench_model(rounds: int) -> dict:
    """Whole-model prefill (one step: the prompt's forward and its first token) of 64 and 512
    tokens on the built-in qwen2.5-0.5b shape, dummy weights, batch 1."""
    from qiao import LLM
    from qiao.bench.common import model_dir
    from qiao.bench.latency import _EngineTimer

    engines = {}
    with model_dir(None, "qwen2.5-0.5b") as path:
        for name, dtype, quant in (
            ("int4", "float32", "int4"),
            ("int8", "float32", "int8"),
            ("bfloat16", "bfloat16", None),
        ):
            llm = LLM(
                str(path),
                load_format="dummy",
                dtype=dtype,
                quantization=quant,
                max_num_seqs=1,
                max_num_batched_tokens=1024,
                max_model_len=1024,
                enable_prefix_caching=False,  # every run computes the whole prompt
                skip_tokenizer_init=True,
                profile=None,
            )
            engines[name] = (llm, _EngineTimer(llm.engine, 1))
            print("loaded", name, flush=True)
        report = {}
        for tokens in (64, 512):
            prompt = list(range(3, 3 + tokens))

            def prefill(name: str, prompt: list[int] = prompt) -> Callable[[], object]:
                return lambda: engines[name][1].run([prompt]).prefill_s

            variants = {
                "int4 float32 tiles (before)": with_bf16_tiles(False, prefill("int4")),
                "int4 bfloat16 tiles (after)": with_bf16_tiles(True, prefill("int4")),
                "int8": prefill("int8"),
                "bfloat16": prefill("bfloat16"),
            }
            samples: dict[str, list[float]] = {n: [] for n in variants}
            names = list(variants)
            for fn in variants.values():
                fn()
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    samples[name].append(variants[name]())
            report[f"prefill {tokens} tokens"] = {
                n: {"ms_median": statistics.median(s) * 1e3, "ms": [v * 1e3 for v in s]}
                for n, s in samples.items()
            }
            print(tokens, {n: round(statistics.median(s) * 1e3, 1) for n, s in samples.items()})
    return report


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2])
    parts = sys.argv[3:] or ["linears", "tiles", "split", "model"]
    benches = {
        "linears": bench_linears,
        "tiles": bench_tiles,
        "split": bench_split,
        "model": bench_model,
    }
    report = {
        "what": __doc__,
        "machine": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "rounds": rounds,
        "bf16_tile_elements": quant_int4.BF16_TILE_ELEMENTS,
    }
    torch.manual_seed(0)
    with torch.inference_mode():
        for part in parts:
            report[part] = benches[part](rounds)
            with open(out, "w") as f:
                json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
