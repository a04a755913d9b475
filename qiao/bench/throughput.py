"""`qiao bench throughput`: offline tokens/s through `LLM.generate`, beside HF in the same run.

Each repeat draws fresh prompts (seed + repeat index) and runs qiao and, with `--compare hf`,
HF `generate()` at every batch size on those same prompts; the order alternates between
repeats so both see the same machine conditions. Reported figures are medians over repeats.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qiao.bench.common import (
    EngineArgs,
    LengthSpec,
    Workload,
    context_len,
    device_note,
    make_workload,
    median,
    model_dir,
    ratio,
)
from qiao.bench.flops import sequence_flops
from qiao.errors import ConfigError

if TYPE_CHECKING:
    from qiao.entrypoints.llm import LLM
    from qiao.models.arch_config import ArchConfig


@dataclass
class ThroughputConfig:
    model: str | None
    shape: str | None
    num_prompts: int = 64
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    ignore_eos: bool = True
    dtype: str = "float32"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    cuda_graphs: bool | None = None  # None: the device's default (on for CUDA)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    repeat: int = 1
    seed: int = 0
    compare_hf: bool = False
    hf_batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    ceiling_gflops: float | None = None  # None: measure it in this run
    quick_ceiling: bool = False  # measure the ceiling on a small matmul (tests)

    def engine_args(self) -> EngineArgs:
        # (With --compare hf, qiao loads HF's weights instead: build_with_hf_twin.)
        dummy = self.shape is not None
        return EngineArgs(
            load_format="dummy" if dummy else self.load_format,
            dtype=self.dtype,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=context_len(self.input_len.hi + self.output_len.hi),
            seed=self.seed,
            # HF runs on the CPU, so "auto" means the CPU for a same-machine comparison.
            device="cpu" if self.compare_hf and self.device == "auto" else self.device,
            cuda_graphs=self.cuda_graphs,
        )


def run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    """Run the benchmark; return the report (as written by `--json`)."""
    from qiao.bench.hf_baseline import build_llm_and_baseline
    from qiao.bench.hw import measure_ceiling_gflops
    from qiao.models.arch_config import load_arch_config

    if cfg.compare_hf and not cfg.ignore_eos:
        raise ConfigError("--compare hf needs --ignore-eos: HF must generate as many tokens")
    with model_dir(cfg.model, cfg.shape) as path:
        arch = load_arch_config(path)
        llm, hf = build_llm_and_baseline(path, cfg.engine_args(), cfg.compare_hf)
        # The compute dtype's ceiling: float32's for the default --dtype float32.
        ceiling_dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        if cfg.quantization == "int8":
            ceiling_dtype = "bfloat16"  # int8 weights multiply in bfloat16 beyond a few rows
        ceiling = cfg.ceiling_gflops or measure_ceiling_gflops(ceiling_dtype, cfg.quick_ceiling)
        batch_sizes = [b for b in cfg.hf_batch_sizes if b <= cfg.num_prompts]
        _warm_up(llm, hf, arch.vocab_size)
        qiao_runs, hf_runs = _repeat_runs(cfg, llm, hf, arch, batch_sizes)
    report = _qiao_summary(qiao_runs, ceiling, ceiling_dtype)
    report["config"] = _config_dict(cfg)
    report["device"] = str(llm.engine.runner.device)
    report["cuda_graphs"] = llm.engine.runner.use_cuda_graphs
    if hf is not None:
        report["hf"] = _hf_summary(hf_runs, report["output_tok_s"])
    return report


def _repeat_runs(
    cfg: ThroughputConfig, llm: LLM, hf: Any, arch: ArchConfig, batch_sizes: list[int]
) -> tuple[list[dict[str, float]], dict[int, list[float]]]:
    qiao_runs: list[dict[str, float]] = []
    hf_runs: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for index in range(cfg.repeat):
        workload = make_workload(
            cfg.num_prompts, cfg.input_len, cfg.output_len, arch.vocab_size, cfg.seed + index
        )
        # Alternate who goes first, so a drift in machine load does not favour one side.
        hf_first = index % 2 == 1
        if hf is not None and hf_first:
            _run_hf_sizes(hf, workload, batch_sizes, hf_runs)
        qiao_runs.append(_run_qiao(llm, arch, workload, cfg.ignore_eos))
        if hf is not None and not hf_first:
            _run_hf_sizes(hf, workload, batch_sizes, hf_runs)
    return qiao_runs, hf_runs


def _warm_up(llm: LLM, hf: Any, vocab_size: int) -> None:
    """One short run each, so first-call costs (allocation, lazy init) stay out of the timing."""
    workload = make_workload(2, LengthSpec(8, 8), LengthSpec(4, 4), vocab_size, seed=-1)
    _run_qiao(llm, None, workload, ignore_eos=True)
    if hf is not None:
        from qiao.bench.hf_baseline import hf_generate

        hf_generate(hf, workload.prompts, workload.output_lens, batch_size=2)


def _run_qiao(
    llm: LLM, arch: ArchConfig | None, workload: Workload, ignore_eos: bool
) -> dict[str, float]:
    from qiao.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
        for n in workload.output_lens
    ]
    begin = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - begin
    output_lens = [len(o.outputs[0].token_ids) for o in outputs]
    num_output = sum(output_lens)
    num_prompt = workload.num_prompt_tokens
    flops = 0
    if arch is not None:
        flops = sum(
            sequence_flops(arch, len(p), n)
            for p, n in zip(workload.prompts, output_lens, strict=True)
        )
    return {
        "seconds": seconds,
        "num_requests": len(outputs),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "requests_per_s": len(outputs) / seconds,
        "output_tok_s": num_output / seconds,
        "total_tok_s": (num_prompt + num_output) / seconds,
        "flops": flops,
        "achieved_gflops": flops / seconds / 1e9,
    }


def _run_hf_sizes(
    hf: Any, workload: Workload, batch_sizes: list[int], runs: dict[int, list[float]]
) -> None:
    """Append HF's output tok/s at each batch size. Only the requested tokens count: what a
    static batch generates past a request's own length is waste."""
    from qiao.bench.hf_baseline import hf_generate

    for batch_size in batch_sizes:
        seconds, _ = hf_generate(hf, workload.prompts, workload.output_lens, batch_size)
        runs[batch_size].append(workload.num_output_tokens / seconds)


def _qiao_summary(
    runs: list[dict[str, float]], ceiling_gflops: float, ceiling_dtype: str
) -> dict[str, Any]:
    summary: dict[str, Any] = {key: median([r[key] for r in runs]) for key in runs[0]}
    summary["ceiling_gflops"] = ceiling_gflops
    summary["ceiling_dtype"] = ceiling_dtype
    summary["share_of_ceiling"] = summary["achieved_gflops"] / ceiling_gflops
    summary["runs"] = runs
    return summary


def _hf_summary(runs: dict[int, list[float]], qiao_output_tok_s: float) -> dict[str, Any]:
    by_size = {b: median(v) for b, v in runs.items() if v}
    best = max(by_size, key=by_size.__getitem__) if by_size else None
    best_tok_s = by_size[best] if best is not None else None
    return {
        "output_tok_s_by_batch_size": by_size,
        "runs_by_batch_size": runs,
        "best_batch_size": best,
        "best_output_tok_s": best_tok_s,
        "qiao_over_hf_output_tok_s": ratio(qiao_output_tok_s, best_tok_s),
    }


def _config_dict(cfg: ThroughputConfig) -> dict[str, Any]:
    d = dict(vars(cfg))
    d["input_len"] = str(cfg.input_len)
    d["output_len"] = str(cfg.output_len)
    return d


def format_throughput(report: dict[str, Any]) -> str:
    c = report["config"]
    source = c["shape"] or c["model"]
    quant = f" weights as {c['quantization']}" if c.get("quantization") else ""
    if c.get("kv_cache_dtype", "auto") != "auto":
        quant += f", KV cache {c['kv_cache_dtype']}"
    lines = [
        f"throughput: {source}, {c['dtype']}{quant}, {c['num_prompts']} prompts, input {c['input_len']}, "
        f"output {c['output_len']}, median of {c['repeat']}{device_note(report)}",
        f"  requests/s        {report['requests_per_s']:10.2f}",
        f"  output tok/s      {report['output_tok_s']:10.1f}",
        f"  total tok/s       {report['total_tok_s']:10.1f}",
        f"  achieved GFLOP/s  {report['achieved_gflops']:10.2f}  "
        f"({report['share_of_ceiling']:.1%} of the {report['ceiling_dtype']} matmul ceiling, "
        f"{report['ceiling_gflops']:.1f} GFLOP/s)",
    ]
    hf = report.get("hf")
    if hf:
        lines.append("  HF transformers generate(), same weights, output tok/s:")
        for size, tok_s in hf["output_tok_s_by_batch_size"].items():
            lines.append(f"    batch {size:<4} {tok_s:10.1f}")
        if hf["qiao_over_hf_output_tok_s"] is not None:
            lines.append(
                f"  qiao / HF (best, batch {hf['best_batch_size']}): "
                f"{hf['qiao_over_hf_output_tok_s']:.2f}x"
            )
    return "\n".join(lines)
