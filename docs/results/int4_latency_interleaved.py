"""Batch-1 decode on the Qwen2.5-0.5B shape (dummy weights): float32, bfloat16, int8 and int4
loaded side by side in one process, their decode runs interleaved round by round (the order
rotating), so the load other work puts on the machine falls on every variant alike."""

import json
import platform
import statistics
import sys
import time

import torch

from qiao import LLM
from qiao.bench.common import model_dir, weight_bytes_per_decode_step
from qiao.bench.hw import measure_copy_gbps
from qiao.bench.latency import _EngineTimer

out, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
variants = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4")]
names = [q or d for d, q in variants]
with model_dir(None, "qwen2.5-0.5b") as path:
    timers, loads, weight_bytes = {}, {}, {}
    for (dtype, quant), name in zip(variants, names, strict=True):
        t = time.time()
        llm = LLM(
            str(path),
            load_format="dummy",
            dtype=dtype,
            quantization=quant,
            max_num_seqs=1,
            skip_tokenizer_init=True,
            profile=None,
        )
        loads[name] = time.time() - t
        timers[name] = _EngineTimer(llm.engine, steps)
        weight_bytes[name] = weight_bytes_per_decode_step(llm.engine.runner.model)
        timers[name].run([[1] * 16])  # warm-up
        print("loaded", name, round(loads[name], 1), "s", weight_bytes[name], flush=True)
    copy_before = measure_copy_gbps()
    samples = {n: [] for n in names}
    prefills = {n: [] for n in names}
    prompt = list(range(3, 67))
    for r in range(rounds):
        order = names[r % 4 :] + names[: r % 4]
        for name in order:
            timing = timers[name].run([prompt])
            samples[name].append(timing.decode_step_s)
            prefills[name].append(timing.prefill_s)
        print(r, {n: round(samples[n][-1] * 1e3, 1) for n in names}, flush=True)
    copy_after = measure_copy_gbps()
report = {
    "what": __doc__,
    "machine": platform.processor() or platform.machine(),
    "cpu_threads": torch.get_num_threads(),
    "rounds": rounds,
    "decode_steps_per_run": steps,
    "copy_gbps_before": copy_before,
    "copy_gbps_after": copy_after,
    "variants": {},
}
for n in names:
    med = statistics.median(samples[n])
    report["variants"][n] = {
        "decode_step_s_median": med,
        "decode_step_s_min": min(samples[n]),
        "decode_tok_s_batch_1": 1 / med,
        "weight_bytes": weight_bytes[n],
        "achieved_gbps_median": weight_bytes[n] / med / 1e9,
        "achieved_gbps_best": weight_bytes[n] / min(samples[n]) / 1e9,
        "load_s": loads[n],
        "run_medians_s": samples[n],
        "prefill_64_tokens_s_median": statistics.median(prefills[n]),
        "prefill_tok_s_batch_1": 64 / statistics.median(prefills[n]),
    }
v = report["variants"]
report["int4_over_int8"] = v["int8"]["decode_step_s_median"] / v["int4"]["decode_step_s_median"]
report["int4_over_float32"] = (
    v["float32"]["decode_step_s_median"] / v["int4"]["decode_step_s_median"]
)
report["int4_over_int8_best"] = v["int8"]["decode_step_s_min"] / v["int4"]["decode_step_s_min"]
for n in names:
    print(n, {k: round(x, 4) for k, x in v[n].items() if isinstance(x, float)})
print(
    "int4/int8",
    report["int4_over_int8"],
    "best",
    report["int4_over_int8_best"],
    "int4/f32",
    report["int4_over_float32"],
)
with open(out, "w") as f:
    json.dump(report, f, indent=2)
