"""`qiao bench latency`: prefill time and per-token decode time, through the engine's `step()`.

A run adds the batch's requests, times the one step that prefills them all (the token budget is
raised so no prompt is chunked), then times each of `--decode-steps` decode steps; the decode
figure is the median step. A decode step reads every weight once (of a mixture-of-experts layer
the experts the batch is expected to route to: `weight_bytes_per_decode_step` at the run's batch
size), so weight bytes / step time is the bandwidth it achieved; the copy bandwidth measured
here bounds it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qiao.bench.common import (
    EngineArgs,
    LengthSpec,
    context_len,
    device_note,
    make_workload,
    median,
    model_dir,
    ratio,
    weight_bytes_per_decode_step,
)

if TYPE_CHECKING:
    from qiao.engine.llm_engine import LLMEngine


@dataclass
class LatencyConfig:
    model: str | None
    shape: str | None
    input_len: int = 128
    batch_size: int = 8
    decode_steps: int = 32
    dtype: str = "float32"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    cuda_graphs: bool | None = None  # None: the device's default (on for CUDA)
    repeat: int = 3
    seed: int = 0
    compare_hf: bool = False
    copy_gbps: float | None = None  # None: measure it in this run
    quick_bandwidth: bool = False  # measure bandwidth on a small tensor (tests)

    def engine_args(self) -> EngineArgs:
        # (With --compare hf, qiao loads HF's weights instead: build_with_hf_twin.)
        dummy = self.shape is not None
        return EngineArgs(
            load_format="dummy" if dummy else self.load_format,
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.batch_size,
            # The whole batch's prompts in one step: prefill time is one step's time.
            max_num_batched_tokens=max(self.batch_size * self.input_len, 2048),
            max_model_len=context_len(self.input_len + self.decode_steps + 1),
            seed=self.seed,
            # HF runs on the CPU, so "auto" means the CPU for a same-machine comparison.
            device="cpu" if self.compare_hf and self.device == "auto" else self.device,
            cuda_graphs=self.cuda_graphs,
        )


@dataclass(frozen=True)
class BatchTiming:
    prefill_s: float  # the step that computes every prompt and samples each first token
    decode_step_s: float  # median decode step (one new token for each sequence)
    # Median share of a decode step spent outside the model's forward and logits: scheduling,
    # input building, sampling, output processing.
    step_overhead: float


class _ModelClock:
    """Seconds spent inside the model's `forward` and `compute_logits` (wrapped in place)."""

    def __init__(self, model: Any, device: Any) -> None:
        self.seconds = 0.0
        self._sync = device.type == "cuda"
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn: Any) -> Any:
        import torch

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._sync:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            out = fn(*args, **kwargs)
            if self._sync:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - begin
            return out

        return timed


class _EngineTimer:
    """Drives the engine step by step and times prefill and decode for one batch."""

    def __init__(self, engine: LLMEngine, decode_steps: int) -> None:
        self.engine = engine
        self.decode_steps = decode_steps
        self._ids = itertools.count()
        self.clock = _ModelClock(engine.runner.model, engine.runner.device)

    def run(self, prompts: list[list[int]]) -> BatchTiming:
        from qiao.sampling_params import SamplingParams

        # One token from prefill, then exactly `decode_steps` decode steps.
        params = SamplingParams(temperature=0.0, max_tokens=self.decode_steps + 1, ignore_eos=True)
        for prompt in prompts:
            self.engine.add_request(f"latency-{next(self._ids)}", prompt, params)
        prefill_s, _ = self._timed_step(len(prompts), "prefill")
        steps = [self._timed_step(len(prompts), "decode") for _ in range(self.decode_steps)]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        overhead = median([1 - in_model / total for total, in_model in steps])
        return BatchTiming(prefill_s, median([total for total, _ in steps]), overhead)

    def _timed_step(self, batch_size: int, phase: str) -> tuple[float, float]:
        """(seconds of the step, seconds of it inside the model)."""
        before = self.engine.num_generated_tokens_total
        in_model = self.clock.seconds
        begin = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - begin
        in_model = self.clock.seconds - in_model
        produced = self.engine.num_generated_tokens_total - before
        if produced != batch_size:
            # Then the step was not the phase we mean to time (a chunked prompt, a preemption).
            raise RuntimeError(f"{phase} step produced {produced} tokens for {batch_size} requests")
        return seconds, in_model


def run_latency(cfg: LatencyConfig) -> dict[str, Any]:
    """Run the benchmark; return the report (as written by `--json`)."""
    from qiao.bench.hf_baseline import build_llm_and_baseline
    from qiao.bench.hw import QUICK_COPY_MIB, measure_copy_gbps
    from qiao.models.arch_config import load_arch_config

    with model_dir(cfg.model, cfg.shape) as path:
        arch = load_arch_config(path)
        llm, hf = build_llm_and_baseline(path, cfg.engine_args(), cfg.compare_hf)
        copy_gbps = cfg.copy_gbps or (
            measure_copy_gbps(QUICK_COPY_MIB) if cfg.quick_bandwidth else measure_copy_gbps()
        )
        timer = _EngineTimer(llm.engine, cfg.decode_steps)
        # Warm-up at the batch size under test, so first-call allocations stay out of timing.
        warm_up = make_workload(
            cfg.batch_size, LengthSpec(8, 8), LengthSpec(1, 1), arch.vocab_size, -1
        )
        timer.run(warm_up.prompts)
        runs = _repeat_runs(cfg, timer, hf, arch.vocab_size)
        weight_bytes = weight_bytes_per_decode_step(llm.engine.runner.model, cfg.batch_size)
    report = _summary(cfg, runs, weight_bytes, copy_gbps)
    report["device"] = str(llm.engine.runner.device)
    report["cuda_graphs"] = llm.engine.runner.use_cuda_graphs
    return report


def _repeat_runs(
    cfg: LatencyConfig, timer: _EngineTimer, hf: Any, vocab_size: int
) -> list[dict[str, float]]:
    from qiao.bench.hf_baseline import hf_prefill_and_decode

    one = LengthSpec(1, 1)
    length = LengthSpec(cfg.input_len, cfg.input_len)
    if hf is not None:  # warm-up
        hf_prefill_and_decode(hf, [1] * 8, 1)
    runs = []
    for index in range(cfg.repeat):
        seed = cfg.seed + index
        prompts = make_workload(cfg.batch_size, length, one, vocab_size, seed).prompts
        run: dict[str, float] = {}
        # HF goes first on odd repeats, so drifting machine load favours neither side.
        if hf is not None and index % 2 == 1:
            run.update(_hf_run(hf, prompts[0], cfg.decode_steps))
        single = timer.run(prompts[:1])
        batch = timer.run(prompts)
        run.update(
            prefill_s_batch_1=single.prefill_s,
            decode_step_s_batch_1=single.decode_step_s,
            prefill_s_batch_n=batch.prefill_s,
            decode_step_s_batch_n=batch.decode_step_s,
            step_overhead_batch_1=single.step_overhead,
            step_overhead_batch_n=batch.step_overhead,
        )
        if hf is not None and index % 2 == 0:
            run.update(_hf_run(hf, prompts[0], cfg.decode_steps))
        runs.append(run)
    return runs


def _hf_run(hf: Any, prompt: list[int], decode_steps: int) -> dict[str, float]:
    from qiao.bench.hf_baseline import hf_prefill_and_decode

    prefill_s, steps = hf_prefill_and_decode(hf, prompt, decode_steps)
    return {"hf_prefill_s_batch_1": prefill_s, "hf_decode_step_s_batch_1": median(steps)}


def _summary(
    cfg: LatencyConfig, runs: list[dict[str, float]], weight_bytes: int, copy_gbps: float
) -> dict[str, Any]:
    m = {key: median([r[key] for r in runs]) for key in runs[0]}
    n, length = cfg.batch_size, cfg.input_len
    report: dict[str, Any] = {
        "config": dict(vars(cfg)),
        **m,
        "prefill_tok_s_batch_1": length / m["prefill_s_batch_1"],
        "prefill_tok_s_batch_n": n * length / m["prefill_s_batch_n"],
        "decode_tok_s_batch_1": 1 / m["decode_step_s_batch_1"],
        "decode_tok_s_batch_n": n / m["decode_step_s_batch_n"],
        "weight_bytes": weight_bytes,
        "weight_gbps_batch_1": weight_bytes / m["decode_step_s_batch_1"] / 1e9,
        "copy_gbps": copy_gbps,
        # The decode floor: a step can't be faster than reading the weights at copy speed.
        "decode_floor_s": weight_bytes / (copy_gbps * 1e9),
        "runs": runs,
    }
    report["share_of_copy_bandwidth"] = report["weight_gbps_batch_1"] / copy_gbps
    if "hf_prefill_s_batch_1" in m:
        hf_prefill = length / m["hf_prefill_s_batch_1"]
        hf_decode = 1 / m["hf_decode_step_s_batch_1"]
        report["hf"] = {
            "prefill_tok_s_batch_1": hf_prefill,
            "decode_tok_s_batch_1": hf_decode,
            "qiao_over_hf_prefill": ratio(report["prefill_tok_s_batch_1"], hf_prefill),
            "qiao_over_hf_decode": ratio(report["decode_tok_s_batch_1"], hf_decode),
        }
    return report


def format_latency(report: dict[str, Any]) -> str:
    c = report["config"]
    source = c["shape"] or c["model"]
    n = c["batch_size"]
    quant = f" weights as {c['quantization']}" if c.get("quantization") else ""
    if c.get("kv_cache_dtype", "auto") != "auto":
        quant += f", KV cache {c['kv_cache_dtype']}"
    lines = [
        f"latency: {source}, {c['dtype']}{quant}, input {c['input_len']}, {c['decode_steps']} decode "
        f"steps, median of {c['repeat']}{device_note(report)}",
        f"  {'':<22} {'batch 1':>12} {f'batch {n}':>12}",
        _row("prefill ms", report["prefill_s_batch_1"] * 1e3, report["prefill_s_batch_n"] * 1e3),
        _row("prefill tok/s", report["prefill_tok_s_batch_1"], report["prefill_tok_s_batch_n"]),
        _row(
            "decode ms/step",
            report["decode_step_s_batch_1"] * 1e3,
            report["decode_step_s_batch_n"] * 1e3,
        ),
        _row("decode tok/s", report["decode_tok_s_batch_1"], report["decode_tok_s_batch_n"]),
        _row(
            "step overhead %",
            report["step_overhead_batch_1"] * 100,
            report["step_overhead_batch_n"] * 100,
        ),
        "  (step overhead: share of a decode step outside the model's forward and logits)",
        f"  batch-1 decode reads {report['weight_bytes'] / 1e6:.1f} MB of weights per step: "
        f"{report['weight_gbps_batch_1']:.2f} GB/s = {report['share_of_copy_bandwidth']:.1%} of "
        f"copy bandwidth {report['copy_gbps']:.1f} GB/s "
        f"(floor {report['decode_floor_s'] * 1e3:.2f} ms/step)",
    ]
    hf = report.get("hf")
    if hf:
        lines += [
            f"  HF forward(), same weights, batch 1: prefill {hf['prefill_tok_s_batch_1']:.1f} "
            f"tok/s, decode {hf['decode_tok_s_batch_1']:.1f} tok/s",
            f"  qiao / HF: prefill {hf['qiao_over_hf_prefill']:.2f}x, "
            f"decode {hf['qiao_over_hf_decode']:.2f}x",
        ]
    return "\n".join(lines)


def _row(label: str, one: float, many: float) -> str:
    return f"  {label:<22} {one:>12.2f} {many:>12.2f}"
